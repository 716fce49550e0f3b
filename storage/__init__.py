"""forgeline's storage: URLs, artifacts and their commit protocol. The only package that sees URL
schemes, fsspec/s3fs and credentials (see `storage.fs` and `storage.artifacts`)."""

from storage.artifacts import (
    MANIFEST,
    ArtifactError,
    ArtifactRef,
    Store,
    code_version,
    fingerprint,
    git_sha,
    sha256_file,
)
from storage.fs import (
    StorageKeyError,
    download_dir,
    download_file,
    exists,
    is_dir,
    join,
    list_files,
    listing_signature,
    local_path,
    normalize_url,
    open_url,
    read_bytes,
    rm,
    scheme_of,
    upload_dir,
    upload_file,
    write_bytes,
)

__all__ = [
    "MANIFEST", "ArtifactError", "ArtifactRef", "Store", "StorageKeyError", "code_version",
    "download_dir", "download_file", "exists", "fingerprint", "git_sha", "is_dir", "join",
    "list_files", "listing_signature", "local_path", "normalize_url", "open_url", "read_bytes", "rm", "scheme_of",
    "sha256_file", "upload_dir", "upload_file", "write_bytes",
]
