"""download:fsspec — fetch URLs/globs (s3://, gs://, file://, local) into a persistent cache.

One listing (globs expanded), then a thread pool fetches each object into
``<cache_dir>/<protocol>/<bucket>/<key>`` through a ``.part`` file that is verified (size, and the
MD5 when the listing's ETag is one) before it is renamed into place; a ``.meta.json`` sidecar with
size + etag is written last. A later run skips files whose sidecar matches the listing, and fetches
again those that changed. Local files are not copied: they are used in place and hashed (MD5,
remembered by size + mtime in the cache), so their digest follows their content.

Every remote call goes through one retry loop (exponential backoff with jitter) that retries
transient failures (5xx, timeouts, dropped connections, a short or corrupt body) and turns
permanent ones (404, missing bucket, bad credentials, no match) into a one-line
:class:`DownloadError`. s3fs/botocore's own retries are set to a single attempt so that every
failure is seen (and counted) here.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import posixpath
import re
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from dflash_core.items import FILE_ITEM
from dflash_core.paths import PATH_FIELD
from dflash_core.retry import call_with_retries, http_status, is_permanent
from dflash_core.stage import Stage, StageContext

_SECRET_KEYS = ("key", "secret", "token", "password", "username", "aws_access_key_id",
                "aws_secret_access_key", "aws_session_token", "credentials", "access_key",
                "secret_key", "session_token", "client_secret", "private_key")
_MAGIC = re.compile(r"[*?\[]")
_HEX_MD5 = re.compile(r"^[0-9a-f]{32}$")


class DownloadError(RuntimeError):
    """A download failure with a one-line, credential-free message."""


class _VerifyError(OSError):
    """The fetched bytes do not match the listing (short read or checksum): retried."""


@dataclass
class DownloadConfig:
    source: str | list[str] = field(metadata={
        **PATH_FIELD, "help": "URL, path or glob, or a list of them (s3://bucket/dir/*.jsonl, gs://…, "
                              "file:///…, ./data/*.jsonl)."})
    workers: int = field(default=8, metadata={"help": "Parallel fetches."})
    retries: int = field(default=5, metadata={
        "help": "Retries per remote call after the first attempt."})
    backoff: float = field(default=0.5, metadata={
        "help": "Base delay in seconds: retry n waits backoff·2^(n-1)·U(0.5, 1.5), at most 60 s."})
    timeout: float = field(default=60.0, metadata={
        "help": "Connect/read timeout in seconds of one request (s3)."})
    storage_options: dict = field(default_factory=dict, metadata={
        "help": "Passed to the fsspec filesystem (s3: endpoint_url, key, secret, anon, client_kwargs, "
                "config_kwargs…)."})

    def __post_init__(self) -> None:
        if isinstance(self.source, str):
            if not self.source.strip():
                raise ValueError("source must not be empty")
        elif not self.source or not all(isinstance(s, str) and s.strip() for s in self.source):
            raise ValueError("source must be a URL/glob or a non-empty list of them")
        if self.workers < 1:
            raise ValueError("workers must be >= 1")
        if self.retries < 0 or self.backoff < 0 or self.timeout <= 0:
            raise ValueError("retries and backoff must be >= 0, timeout > 0")


@dataclass
class _Obj:
    url: str          # canonical source URL
    fs: Any
    path: str         # path as the filesystem names it
    protocol: str
    size: int
    etag: str         # remote: ETag without quotes ("" if none); local: filled with the MD5
    md5: str | None   # expected MD5 (hex) when the listing gives one
    mtime: float = 0.0

    @property
    def local(self) -> bool:
        return self.protocol in ("file", "local")


def _redact(text: str, options: Mapping[str, Any]) -> str:
    """Remove credential values (and URL userinfo) from a message."""
    secrets: list[str] = []

    def collect(d: Any) -> None:
        if isinstance(d, Mapping):
            for k, v in d.items():
                if isinstance(v, Mapping):
                    collect(v)
                elif isinstance(v, str) and v and str(k).lower() in _SECRET_KEYS:
                    secrets.append(v)

    collect(options)
    for env in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        if os.environ.get(env):
            secrets.append(os.environ[env])
    for s in sorted(set(secrets), key=len, reverse=True):
        if len(s) >= 4:
            text = text.replace(s, "***")
    text = re.sub(r"(\w+://)[^/@\s]+@", r"\1***@", text)
    return " ".join(text.split())


def _is_permanent(exc: BaseException) -> bool:
    """Our own errors are final; a verification failure (short read, checksum) is worth a retry."""
    if isinstance(exc, DownloadError):
        return True
    return not isinstance(exc, _VerifyError) and is_permanent(exc)


class _Fetcher:
    def __init__(self, cfg: DownloadConfig, cache_dir: str, logger: Any) -> None:
        self.cfg = cfg
        self.logger = logger
        self.retries = 0
        self._lock = threading.Lock()
        self._fs: dict[str, Any] = {}
        self._stop = threading.Event()
        from fsspec.core import url_to_fs

        self.cache_fs, self.cache_root = url_to_fs(cache_dir)
        self.cache_local = _protocol(self.cache_fs) in ("file", "local")
        if self.cache_local:
            self.cache_root = os.path.abspath(self.cache_root)

    # -- filesystems ---------------------------------------------------------------------------
    def fs_for(self, url: str) -> tuple[Any, str]:
        from fsspec.core import split_protocol, url_to_fs

        proto, _ = split_protocol(url)
        proto = proto or "file"
        if proto in ("file", "local"):
            return url_to_fs(url)
        opts = dict(self.cfg.storage_options)
        if proto in ("s3", "s3a"):
            cfg_kw = {"retries": {"total_max_attempts": 1, "mode": "standard"},
                      "connect_timeout": self.cfg.timeout, "read_timeout": self.cfg.timeout}
            cfg_kw.update(opts.pop("config_kwargs", None) or {})
            opts["config_kwargs"] = cfg_kw
        opts.setdefault("skip_instance_cache", True)
        with self._lock:
            if proto not in self._fs:
                fs, path = url_to_fs(url, **opts)
                if proto in ("s3", "s3a"):
                    fs.retries = 1  # s3fs's own retry wrapper: one attempt, ours does the rest
                self._fs[proto] = fs
            fs = self._fs[proto]
        return fs, fs._strip_protocol(url)

    # -- retries --------------------------------------------------------------------------------
    def call(self, what: str, fn: Any) -> Any:
        def counted(attempt: int, exc: BaseException, _delay: float) -> None:
            with self._lock:
                self.retries += 1
            self.logger.debug("retry %d/%d of %s after %s: %s", attempt, self.cfg.retries, what,
                              type(exc).__name__, _redact(str(exc), self.cfg.storage_options))

        return call_with_retries(fn, retries=self.cfg.retries, backoff=self.cfg.backoff,
                                 permanent=_is_permanent, stop=self._stop.is_set, on_retry=counted)

    # -- cache layout -----------------------------------------------------------------------------
    def cache_path(self, obj: _Obj) -> str:
        rel = obj.path.split("://", 1)[-1] if "://" in obj.path else obj.path
        parts = [p for p in posixpath.normpath("/" + rel.replace("\\", "/")).split("/") if p]
        parts = ["_" if p == ".." else p for p in parts]
        proto = "s3" if obj.protocol == "s3a" else obj.protocol
        if self.cache_local:
            return os.path.join(self.cache_root, proto, *parts)
        return posixpath.join(self.cache_root, proto, *parts)

    def cache_url(self, path: str) -> str:
        return path if self.cache_local else self.cache_fs.unstrip_protocol(path)

    def read_meta(self, path: str) -> dict | None:
        try:
            if self.cache_local:
                with open(path + ".meta.json") as f:
                    return json.load(f)
            return json.loads(self.cache_fs.cat_file(path + ".meta.json"))
        except (OSError, ValueError):
            return None

    def write_meta(self, path: str, meta: dict) -> None:
        data = json.dumps(meta, sort_keys=True).encode()
        if self.cache_local:
            tmp = path + ".meta.json.part"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path + ".meta.json")
        else:
            self.cache_fs.pipe_file(path + ".meta.json", data)

    def cached_size(self, path: str) -> int | None:
        try:
            if self.cache_local:
                return os.path.getsize(path)
            return int(self.cache_fs.info(path)["size"])
        except (OSError, KeyError):
            return None

    # -- one object ---------------------------------------------------------------------------------
    def process(self, obj: _Obj) -> tuple[dict, bool]:
        """Return (item, fetched)."""
        if obj.local:
            return self._local(obj), False
        final = self.cache_path(obj)
        meta = self.read_meta(final)
        if (meta and meta.get("size") == obj.size and meta.get("etag") == obj.etag
                and meta.get("source") == obj.url and self.cached_size(final) == obj.size):
            return self._item(obj, final), False
        if self._stop.is_set():
            raise DownloadError("stopped")
        state: dict[str, Any] = {"prev_md5": None}
        self.call(f"fetch {obj.url}", lambda: self._fetch_once(obj, final, state))
        self.write_meta(final, {"source": obj.url, "size": obj.size, "etag": obj.etag,
                                "md5": state.get("md5")})
        return self._item(obj, final), True

    def _item(self, obj: _Obj, final: str) -> dict:
        return {"path": self.cache_url(final), "source": obj.url, "size": obj.size, "etag": obj.etag}

    def _fetch_once(self, obj: _Obj, final: str, state: dict) -> None:
        if self.cache_local:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            tmp = final + ".part"
        else:
            import tempfile

            fd, tmp = tempfile.mkstemp(prefix="dflash-dl-")
            os.close(fd)
        try:
            obj.fs.get_file(obj.path, tmp)
            size = os.path.getsize(tmp)
            if size != obj.size:
                raise _VerifyError(f"got {size} bytes, listing says {obj.size}")
            md5 = _md5_file(tmp) if obj.md5 else None
            if obj.md5 and md5 != obj.md5:
                # An ETag that is not an MD5 (SSE-KMS/SSE-C) mismatches every time: accept the
                # bytes once two downloads agree with each other.
                if state["prev_md5"] != md5:
                    state["prev_md5"] = md5
                    raise _VerifyError(f"MD5 {md5} does not match ETag {obj.md5}")
                self.logger.warning("%s: ETag is not the MD5 of the content (server-side "
                                    "encryption?); verified by size and a repeated download",
                                    obj.url)
            state["md5"] = md5
            if self.cache_local:
                os.replace(tmp, final)
            else:
                self.cache_fs.put_file(tmp, final)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def _local(self, obj: _Obj) -> dict:
        """Local source: used in place; MD5 remembered in the cache by (size, mtime)."""
        path = os.path.abspath(obj.path)
        memo = self.cache_path(obj) if self.cache_local else None
        meta = self.read_meta(memo) if memo else None
        if meta and meta.get("size") == obj.size and meta.get("mtime") == obj.mtime and meta.get("md5"):
            md5 = meta["md5"]
        else:
            md5 = _md5_file(path)
            if memo:
                os.makedirs(os.path.dirname(memo), exist_ok=True)
                self.write_meta(memo, {"source": obj.url, "size": obj.size, "mtime": obj.mtime,
                                       "md5": md5})
        return {"path": path, "source": obj.url, "size": obj.size, "etag": md5}


def _protocol(fs: Any) -> str:
    p = fs.protocol
    return p[0] if isinstance(p, (tuple, list)) else p


def _md5_file(path: str) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _etag_md5(info: Mapping[str, Any]) -> tuple[str, str | None]:
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"')
    md5: str | None = None
    if _HEX_MD5.match(etag.lower()):
        md5 = etag.lower()  # single-part S3 upload: the ETag is the MD5 of the content
    elif info.get("md5Hash"):  # GCS: base64 MD5
        try:
            md5 = base64.b64decode(info["md5Hash"]).hex()
        except (ValueError, TypeError):
            md5 = None
        etag = etag or str(info["md5Hash"])
    return etag, md5


def _bucket(protocol: str, path: str) -> str | None:
    if protocol in ("s3", "s3a", "gs", "gcs", "abfs", "az", "oss"):
        return path.split("/", 1)[0]
    return None


class FsspecDownload(Stage):
    """Fetch files from object stores / local paths into a persistent, verified cache."""

    kind = "download"
    name = "fsspec"
    version = "1"
    Config = DownloadConfig
    inputs = ()
    output = FILE_ITEM
    default_link = "materialize"
    always_run = True
    cache_ignore = ("workers", "retries", "backoff", "timeout")

    def run(self, inputs: Mapping[str, Any], ctx: StageContext) -> Iterator[dict]:
        cfg: DownloadConfig = self.config
        cache_dir = getattr(ctx, "cache_dir", None) or os.path.join(ctx.run_dir, "cache", ctx.stage)
        fetcher = _Fetcher(cfg, cache_dir, ctx.logger)
        t0 = time.monotonic()
        try:
            objs = self._list(fetcher, cfg)
        except DownloadError:
            raise
        except Exception as exc:
            raise DownloadError(self._describe(exc, "listing", cfg)) from None
        n = len(objs)
        total_bytes = sum(o.size for o in objs)
        ctx.logger.info("download: %d files, %d bytes", n, total_bytes)
        ctx.progress(0, total=n, unit="files", bytes=0)
        summary = {"files": n, "bytes": total_bytes, "fetched": 0, "skipped": 0, "local": 0,
                   "retries": 0, "fetched_bytes": 0}
        ctx.summary.update(summary)

        pool = ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix=f"{ctx.stage}-dl")
        futures: list[Future] = [pool.submit(fetcher.process, o) for o in objs]
        index = {f: i for i, f in enumerate(futures)}
        results: dict[int, tuple[dict, bool]] = {}
        pending = set(futures)
        next_out = 0
        try:
            while next_out < n:
                if ctx.should_stop():
                    return
                done, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                for fut in done:
                    i = index[fut]
                    exc = fut.exception()
                    if exc is not None:
                        if isinstance(exc, DownloadError):
                            raise exc
                        raise DownloadError(self._describe(exc, objs[i].url, cfg)) from None
                    item, fetched = fut.result()
                    results[i] = (item, fetched)
                    obj = objs[i]
                    key = "local" if obj.local else ("fetched" if fetched else "skipped")
                    summary[key] += 1
                    if fetched:
                        summary["fetched_bytes"] += obj.size
                    summary["retries"] = fetcher.retries
                    ctx.summary.update(summary)
                    ctx.progress(1, total=n, unit="files", bytes=obj.size)
                while next_out in results:
                    item, _ = results.pop(next_out)
                    next_out += 1
                    yield item
        finally:
            fetcher._stop.set()
            for f in pending:
                f.cancel()
            pool.shutdown(wait=True, cancel_futures=True)
            summary["retries"] = fetcher.retries
            secs = time.monotonic() - t0
            summary["seconds"] = round(secs, 3)
            ctx.summary.update(summary)

    # -- listing ------------------------------------------------------------------------------------
    def _list(self, fetcher: _Fetcher, cfg: DownloadConfig) -> list[_Obj]:
        sources = [cfg.source] if isinstance(cfg.source, str) else list(cfg.source)
        found: dict[str, _Obj] = {}
        for src in sources:
            src = src.strip()
            try:
                fs, path = fetcher.fs_for(src)
                proto = _protocol(fs)
                infos = fetcher.call(f"list {src}", lambda: self._expand(fs, path))
            except DownloadError:
                raise
            except Exception as exc:
                raise DownloadError(self._describe(exc, src, cfg)) from None
            if not infos:
                raise DownloadError(self._no_match(fetcher, fs, proto, path, src, cfg))
            for name, info in infos.items():
                url = fs.unstrip_protocol(name)
                etag, md5 = _etag_md5(info)
                found[url] = _Obj(url=url, fs=fs, path=name, protocol=proto,
                                  size=int(info.get("size") or 0), etag=etag, md5=md5,
                                  mtime=float(info.get("mtime") or 0.0))
        return [found[k] for k in sorted(found)]

    @staticmethod
    def _expand(fs: Any, path: str) -> dict[str, dict]:
        if _MAGIC.search(path):
            hits = fs.glob(path, detail=True)
        else:
            info = fs.info(path)
            if info.get("type") == "directory":
                hits = fs.find(path, detail=True)
            else:
                hits = {info.get("name", path): info}
        return {k: v for k, v in hits.items() if v.get("type", "file") == "file"}

    def _no_match(self, fetcher: _Fetcher, fs: Any, proto: str, path: str, src: str,
                  cfg: DownloadConfig) -> str:
        shown = _redact(src, cfg.storage_options)
        bucket = _bucket(proto, path)
        if bucket:
            try:
                exists = fetcher.call(f"check bucket {bucket}", lambda: fs.exists(bucket))
            except Exception as exc:  # noqa: BLE001
                return self._describe(exc, src, cfg)
            if not exists:
                return f"bucket '{bucket}' does not exist (source {shown})"
        return f"no files match '{shown}'"

    @staticmethod
    def _describe(exc: BaseException, what: str, cfg: DownloadConfig) -> str:
        opts = cfg.storage_options
        what = _redact(what, opts)
        msg = _redact(str(exc) or type(exc).__name__, opts)
        name = type(exc).__name__
        if name in ("NoCredentialsError", "PartialCredentialsError"):
            return (f"no usable credentials for {what}: {msg} (set storage_options key/secret, "
                    f"AWS_* environment variables or a profile; anon: true for public buckets)")
        if isinstance(exc, PermissionError) or http_status(exc) == 403:
            return (f"access denied for {what}: {msg} (check the credentials: storage_options "
                    f"key/secret, AWS_* environment variables or profile)")
        if isinstance(exc, FileNotFoundError):
            if "bucket" in msg.lower():
                return f"bucket not found for {what}: {msg}"
            return f"not found (404): {what}"
        if _is_permanent(exc):
            return f"cannot fetch {what}: {name}: {msg}"
        return (f"cannot fetch {what} after {cfg.retries} retries: {name}: {msg}")
