"""forgeline's storage: URLs, artifacts and their commit protocol. The only package that sees URL
schemes, fsspec/s3fs and credentials (see `storage.fs` and `storage.artifacts`)."""

from storage.artifacts import (
    MANIFEST,
    ArtifactError,
    ArtifactRef,
    IntegrityError,
    Store,
    cache_root,
    content_digest,
    fingerprint,
    git_sha,
    sha256_file,
)
from storage.fs import (
    StorageKeyError,
    StoreUnavailable,
    check_key,
    check_store,
    create_bytes,
    download_dir,
    download_file,
    exists,
    is_dir,
    join,
    list_files,
    listing_signature,
    local_file,
    local_path,
    normalize_url,
    open_url,
    read_bytes,
    read_ranges,
    rm,
    scheme_of,
    size_of,
    upload_dir,
    upload_file,
    write_bytes,
)
from storage.leases import Lease, LeaseLost

__all__ = [
    "ArtifactError", "ArtifactRef", "IntegrityError", "Lease", "LeaseLost", "MANIFEST", "StorageKeyError", "Store",
    "StoreUnavailable", "cache_root", "check_key", "check_store", "content_digest", "create_bytes",
    "download_dir", "download_file", "exists", "fingerprint", "git_sha", "is_dir", "join", "list_files",
    "listing_signature", "local_file", "local_path", "normalize_url", "open_url", "read_bytes", "read_ranges", "rm",
    "scheme_of", "size_of",
    "sha256_file", "upload_dir", "upload_file", "write_bytes",
]
