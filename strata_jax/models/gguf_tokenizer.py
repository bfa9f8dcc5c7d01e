"""The tokenizer a GGUF file describes, rebuilt with the ``tokenizers`` library as HF files.

GGUF keeps the vocabulary, merges, token types, special-token ids and chat template in its
metadata; this writes them out as ``tokenizer.json`` / ``tokenizer_config.json`` /
``chat_template.jinja`` so the ordinary ``HFTokenizer`` (and ``strata-jax convert``) use them.
Two tokenizer models cover the supported architectures: ``gpt2`` (byte-level BPE: Llama 3,
Qwen 2/3, SmolLM) and ``llama`` (SentencePiece BPE with byte fallback: Llama 2, Mistral).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
)

from strata_jax.models.gguf_file import GGUFError, GGUFFile

# llama.cpp token types (llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) -> the regexes it splits text with, in order.
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_SPLIT,),
    "gpt2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
}
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what byte-level BPE vocabularies spell)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


def _split_pre_tokenizer(regexes: tuple[str, ...]) -> pre_tokenizers.PreTokenizer:
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in regexes]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _byte_level_tokenizer(gguf: GGUFFile, tokens: list[str], types: list[int]) -> Tokenizer:
    pre = gguf.field("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise GGUFError(
            f"{gguf.path}: tokenizer pre-type {pre!r} is not supported (supported: "
            f"{', '.join(sorted(PRE_TOKENIZER_SPLITS))})"
        )
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab: dict[str, int] = {}
    for index, (token, kind) in enumerate(zip(tokens, types)):
        if kind == _NORMAL and not set(token) <= spelled:  # a few converters store raw text: respell it
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    merges = gguf.field("tokenizer.ggml.merges")
    if not merges:
        raise GGUFError(f"{gguf.path}: a gpt2 (byte-level BPE) tokenizer needs tokenizer.ggml.merges")
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _split_pre_tokenizer(PRE_TOKENIZER_SPLITS[pre])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_tokenizer(gguf: GGUFFile, tokens: list[str], types: list[int]) -> Tokenizer:
    scores = gguf.field("tokenizer.ggml.scores")
    merges = gguf.field("tokenizer.ggml.merges")
    vocab = {token: index for index, token in enumerate(tokens)}
    if merges:
        pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    elif scores is not None:
        pairs = _merges_from_scores(tokens, [float(s) for s in scores], types)
    else:
        raise GGUFError(f"{gguf.path}: a llama (SentencePiece) tokenizer needs tokenizer.ggml.scores or merges")
    unk_id = gguf.field("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(gguf.field("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence([*steps, decoders.Strip(content=" ", left=1, right=0)] if prefix else steps)
    return tokenizer


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges best-scoring pieces first; recover the merge list that implies."""
    vocab = {token: index for index, token in enumerate(tokens)}
    candidates = []
    for token, score, kind in zip(tokens, scores, types):
        if kind != _NORMAL or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                candidates.append((-score, vocab[left], vocab[right], left, right))
    candidates.sort()
    return [(left, right) for _, _, _, left, right in candidates]


def has_tokenizer(gguf: GGUFFile) -> bool:
    return gguf.field("tokenizer.ggml.model") is not None


def build_tokenizer(gguf: GGUFFile) -> tuple[Tokenizer, dict[str, Any]]:
    """``(tokenizer, tokenizer_config)`` as the file's metadata describes them."""
    model = gguf.field("tokenizer.ggml.model")
    tokens = gguf.field("tokenizer.ggml.tokens")
    if model is None or not tokens:
        raise GGUFError(f"{gguf.path} holds no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens)")
    types = [int(t) for t in (gguf.field("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))]
    if model == "gpt2":
        tokenizer = _byte_level_tokenizer(gguf, tokens, types)
        default_bos = False
    elif model == "llama":
        tokenizer = _sentencepiece_tokenizer(gguf, tokens, types)
        default_bos = True  # llama.cpp adds BOS to SentencePiece vocabularies that do not say otherwise
    else:
        raise GGUFError(f"{gguf.path}: tokenizer model {model!r} is not supported (supported: gpt2, llama)")
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == _CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == _USER_DEFINED]
    )

    def token(key: str) -> str | None:
        index = gguf.field(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(gguf.field("tokenizer.ggml.add_bos_token", default_bos))
    add_eos = bool(gguf.field("tokenizer.ggml.add_eos_token", False))
    _set_post_processor(tokenizer, gguf, bos if add_bos else None, eos if add_eos else None)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "model_max_length": int(gguf.field(f"{gguf.architecture}.context_length", 4096)),
        "clean_up_tokenization_spaces": False,
    }
    template = gguf.field("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return tokenizer, {k: v for k, v in config.items() if v is not None}


def _set_post_processor(tokenizer: Tokenizer, gguf: GGUFFile, bos: str | None, eos: str | None) -> None:
    if bos is None and eos is None:
        return
    single = " ".join(filter(None, (f"{bos}:0" if bos else None, "$A:0", f"{eos}:0" if eos else None)))
    pair = " ".join(filter(None, (single, f"{bos}:1" if bos else None, "$B:1", f"{eos}:1" if eos else None)))
    specials = [(t, tokenizer.token_to_id(t)) for t in (bos, eos) if t]
    tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def write_tokenizer_files(gguf: GGUFFile, folder: Path) -> dict[str, Any]:
    """Write tokenizer.json, tokenizer_config.json (and chat_template.jinja) into ``folder``."""
    tokenizer, config = build_tokenizer(gguf)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False))
    if "chat_template" in config:
        (folder / CHAT_TEMPLATE_FILE).write_text(config["chat_template"])
    return config
