"""kvzip's settings checked while vLLM builds its config: before the engine starts, before
the model loads, before a server reports ready.

vLLM builds its config in the process that starts it (``vllm serve``'s API server, the
``LLM(...)`` caller) with ``EngineArgs.create_engine_config`` (vLLM 0.26, 0.32 and 0.33
alike), after it has loaded the general plugins (``EngineArgs.__post_init__``, or the CLI's
argument parser) and before it starts the engine core that loads the model. :func:`install`
(called by the plugin) wraps that method so that :func:`check_config` runs on the config it
returns, complete (the model's ``hf_config`` read, the platform's block size set). A setting
that cannot work raises :class:`~kvzip_vllm.support.UnsupportedConfigError` there, naming
the setting and the remedy: ``vllm serve`` exits, ``LLM(...)`` raises. The same checks still
run where each part starts (the backend's layers, the connector), as before. (Not the
platform's ``check_and_update_config``, which ``VllmConfig.__post_init__`` calls: vLLM also
builds configs inside its workers, ``dataclasses.replace``, where the tier's arena is
already allocated and the memory check would no longer hold.)

Checked: the compact-format backend's format name, its calibration (present for a format
that needs one, loadable, of this model's shape: layers, query and KV heads, head size), its
window slot size; the model, dtype, parallelism and cache dtype each part supports; the
tier's settings (``kv_connector_extra_config`` and its variables), its chunk size against
vLLM's block size, and its arena against the host's available memory. Not checked: that a
calibration of the same shape comes from this model's very weights (that needs the weights
hashed; a calibration records the identity ``kvzip calibrate`` gave the model).
"""

from __future__ import annotations

import functools
import logging

from kvzip_formats import settings as table
from kvzip_vllm import support
from kvzip_vllm.settings import (
    CONNECTOR_ENV,
    ConnectorSettingsError,
    backend_enabled,
    backend_settings,
    blocks_per_chunk,
    connector_settings,
    load_format,
)

logger = logging.getLogger("vllm.kvzip.startup")

#: connector names and module paths that select the tier
CONNECTOR_NAMES = ("KvzipConnector",)
CONNECTOR_MODULES = ("kvzip_vllm.connector",)


def _refuse(msg: str):
    raise support.UnsupportedConfigError(msg)


def connector_requested(vllm_config) -> bool:
    kt = getattr(vllm_config, "kv_transfer_config", None)
    if kt is None:
        return False
    return (
        getattr(kt, "kv_connector", None) in CONNECTOR_NAMES
        or getattr(kt, "kv_connector_module_path", None) in CONNECTOR_MODULES
    )


def check_config(vllm_config) -> None:
    """Refuse the kvzip settings of ``vllm_config`` that cannot work (nothing to check for a
    config without a model, or when no kvzip feature is on)."""
    if getattr(vllm_config, "model_config", None) is None:
        return
    if backend_enabled():
        check_backend(vllm_config)
    if connector_requested(vllm_config):
        check_connector(vllm_config)


# ------------------------------------------------------------------------------ backend
def check_backend(vllm_config) -> None:
    import kvzip_formats
    from kvzip_formats.calibration import CalibrationError

    what = "kvzip-vllm attention backend"
    raw = table.KV_FORMAT.raw()
    try:
        s = backend_settings(vllm_config)
    except ValueError as e:
        msg = str(e)
        if table.KV_FORMAT.name not in msg and table.WINDOW_SLOT_TOKENS.name not in msg:
            msg = f"{table.KV_FORMAT.name}={raw!r}: {msg}"
        _refuse(f"{what}: {msg.removeprefix('kvzip-vllm: ')}")
    names = kvzip_formats.list_formats()
    if s.kv_format not in names:
        _refuse(
            f"{what}: {table.KV_FORMAT.name}={raw!r}: unknown format {s.kv_format!r}; "
            f"supported: {', '.join(names)}, each optionally with a residual window "
            f"(NAME+rN, e.g. 4bit+r128); set {table.KV_FORMAT.name} to one of them"
        )
    needs = getattr(kvzip_formats.get_format(s.kv_format), "needs_calibration", False)
    mc = vllm_config.model_config
    if needs and not s.calibration:
        _refuse(
            f"{what}: {table.KV_FORMAT.name}={raw!r} needs a calibration of the served "
            f"model, and {table.CALIBRATION.name} is not set; make one with `kvzip calibrate "
            f"--model {mc.model} --out DIR` and set {table.CALIBRATION.name}=DIR (or pick a "
            "format without one: "
            + ", ".join(n for n in names if not kvzip_formats.get_format(n).needs_calibration)
            + ")"
        )
    try:
        fmt = load_format(s.kv_format, s.calibration)
    except (CalibrationError, OSError, ValueError) as e:
        _refuse(
            f"{what}: {table.CALIBRATION.name}={s.calibration!r} cannot be read for "
            f"{table.KV_FORMAT.name}={raw!r}: {e}; set {table.CALIBRATION.name} to the "
            f"directory `kvzip calibrate --model {mc.model} --out DIR` made"
        )
    cal = getattr(fmt, "calibration", None) if needs else None
    if cal is not None:
        check_calibration_shape(cal, mc, s.calibration)
    support.check_model(
        mc,
        dtypes=support.SUPPORTED_BACKEND_DTYPES,
        what="attention backend",
        head_sizes=support.SUPPORTED_HEAD_SIZES,
    )
    support.check_parallel(vllm_config.parallel_config, what="attention backend")
    dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    if dtype != "auto":
        _refuse(
            f"{what}: kv_cache_dtype={dtype!r} is not supported with {table.KV_FORMAT.name} "
            "(the format sets the cache bytes); supported: 'auto' (leave --kv-cache-dtype out)"
        )
    from kvzip_vllm.backend import TIER_FORMATS, _connector_refused

    if _connector_refused(vllm_config, fmt, s.recent):
        _refuse(
            f"{what}: a KV connector ({vllm_config.kv_transfer_config.kv_connector}) is not "
            f"supported with {table.KV_FORMAT.name}={raw!r} (its loaded blocks would arrive "
            "without their sequence's sink slot or residual window); supported: "
            f"{table.KV_FORMAT.name} with KvzipConnector and {TIER_FORMATS}, or a KV "
            f"connector without {table.KV_FORMAT.name}"
        )


def model_shape(model_config) -> dict:
    """The served model's (layers, query heads, KV heads, head size), as a calibration
    records them."""
    text = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    return {
        "num_layers": int(text.num_hidden_layers),
        "num_q_heads": int(text.num_attention_heads),
        "num_kv_heads": int(model_config.get_total_num_kv_heads()),
        "head_dim": int(model_config.get_head_size()),
    }


def check_calibration_shape(cal, model_config, directory) -> None:
    got = model_shape(model_config)
    want = {k: int(cal.model.get(k, -1)) for k in got}
    want["num_kv_heads"] = int(cal.model.get("total_kv_heads", want["num_kv_heads"]))
    if want != got:
        differ = ", ".join(f"{k} {want[k]} (model: {got[k]})" for k in got if want[k] != got[k])
        _refuse(
            f"kvzip-vllm attention backend: {table.CALIBRATION.name}={str(directory)!r} was "
            f"made for model {cal.model.get('name')!r}, not the model served "
            f"({model_config.model!r}): {differ}; make this model's calibration with `kvzip "
            f"calibrate --model {model_config.model} --out DIR` and set "
            f"{table.CALIBRATION.name}=DIR"
        )


# ---------------------------------------------------------------------------- connector
def available_memory() -> int:
    """Bytes of host memory available to a new allocation (``MemAvailable``)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # vLLM depends on psutil; a fallback all the same
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_connector(vllm_config) -> None:
    from kvzip_vllm.connector import (
        require_rewinding_model_runner,
        require_synchronous_scheduling,
    )

    what = "kvzip-vllm connector"
    mc = vllm_config.model_config
    support.check_model(mc, dtypes=support.SUPPORTED_CONNECTOR_DTYPES, what="connector")
    support.check_parallel(vllm_config.parallel_config, what="connector")
    dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    if dtype not in ("auto", "bfloat16"):
        _refuse(
            f"{what}: kv_cache_dtype={dtype!r} is not supported; supported: 'auto' with a "
            "bfloat16 model (the tier is lossless on the bf16 cache)"
        )
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    try:
        s = connector_settings(extra)
        block_size = getattr(vllm_config.cache_config, "block_size", None)
        if block_size:  # set by now on 0.26 to 0.33; the connector checks it again anyway
            blocks_per_chunk(s.chunk_tokens, block_size)
    except ConnectorSettingsError as e:
        _refuse(str(e))
    if s.load_mode == "sync":  # restores inside the step: a failed one is rewound after it
        require_rewinding_model_runner(vllm_config)
        require_synchronous_scheduling(vllm_config)
    free = available_memory()
    if s.budget_bytes > free:
        given = (
            "kv_connector_extra_config budget_bytes"
            if isinstance(extra, dict) and "budget_bytes" in extra
            else (
                f"environment variable {CONNECTOR_ENV['budget_bytes']}"
                if table.TIER_BYTES.raw() is not None
                else "the default"
            )
        )
        _refuse(
            f"{what}: budget_bytes={s.budget_bytes} (from {given}) is more than this host's "
            f"available memory ({free} bytes): the tier's arena, allocated at start-up "
            "(page-locked on a CUDA host), could not be held; supported: at most the "
            "available memory less what vLLM itself takes; set budget_bytes (or "
            f"{CONNECTOR_ENV['budget_bytes']}) lower"
        )


# ------------------------------------------------------------------------------- the hook
def install(cls=None) -> bool:
    """Run :func:`check_config` on the config ``cls.create_engine_config`` returns (``cls``:
    vLLM's ``EngineArgs`` by default; ``AsyncEngineArgs`` inherits the method). Idempotent
    (vLLM loads plugins more than once per process); True if installed now."""
    if cls is None:
        from vllm.engine.arg_utils import EngineArgs as cls
    build = cls.create_engine_config
    if getattr(build, "kvzip_checks", False):
        return False

    @functools.wraps(build)
    def create_engine_config(self, *args, **kwargs):
        vllm_config = build(self, *args, **kwargs)
        check_config(vllm_config)
        return vllm_config

    create_engine_config.kvzip_checks = True
    cls.create_engine_config = create_engine_config
    logger.debug("kvzip: start-up checks installed on %s.create_engine_config", cls.__name__)
    return True
