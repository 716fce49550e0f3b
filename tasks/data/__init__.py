"""Text in, token rows out: corpora (where documents come from), chat templates, and the row and
hidden-state file formats the stages exchange (rows.py)."""
