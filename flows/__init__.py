"""forgeline's Prefect layer: the stage task, the release and draft-refresh flows, the CLI, deploy.

Stage code logs through stdlib `logging` under the `forgeline` logger (tasks/ and models/ know
nothing about Prefect); naming it an extra logger here, before Prefect is imported, sends those
lines to the run's logs in the UI as well.
"""

import os

_extra = os.environ.get("PREFECT_LOGGING_EXTRA_LOGGERS", "")
if "forgeline" not in _extra.split(","):
    os.environ["PREFECT_LOGGING_EXTRA_LOGGERS"] = ",".join(x for x in (_extra, "forgeline") if x)

