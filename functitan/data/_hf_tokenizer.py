"""A run's tokenizer as Hugging Face tokenizer files, so an exported model directory is complete.

``AutoTokenizer.from_pretrained(out_dir)`` reads ``tokenizer.json`` + ``tokenizer_config.json`` and encodes
text to the ids the run trained on, with no special token added (the loader adds BOS / EOS around
documents itself, so the export's ``bos_token`` / ``eos_token`` name those ids). The byte tokenizer becomes a
byte-level BPE without merges: GPT-2's byte-to-character table gives each of the 256 bytes one token whose id
is the byte, and BOS / EOS are the special tokens ``<bos>`` (256) and ``<eos>`` (257). A ``tokenizer.json``
the run trained with is written as the run read it; a tiktoken file is refused by name (no converter yet).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from functitan.data._shards import INDEX
from functitan.data._tokenizer import ByteTokenizer, Tokenizer, _HFTokenizer, load_tokenizer

__all__ = ["save_hf_tokenizer", "run_tokenizer", "BYTE_SPECIALS"]

BYTE_SPECIALS = ("<bos>", "<eos>")  # the byte tokenizer's BOS and EOS (ids 256, 257) in its HF form


def run_tokenizer(data: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer a run trained with, from its recorded ``[data]`` section (``config.json``'s ``data``):
    ``data.tokenizer``, else the one ``data.path``'s shards were made with (read from their index, so the
    shards themselves may be gone), else the byte tokenizer."""
    if data.get("tokenizer"):
        return load_tokenizer(Path(data["tokenizer"]))
    if data.get("path"):
        index = Path(data["path"]) / INDEX
        try:
            made = json.loads(index.read_text())["tokenizer"]
        except (OSError, ValueError, KeyError):
            raise ValueError(
                f"the run trained on data.path={data['path']}, whose {INDEX} (naming its tokenizer) cannot be read "
                "now; pass the tokenizer file with --tokenizer"
            ) from None
        return ByteTokenizer() if made.get("kind") == "byte" else load_tokenizer(Path(made["path"]))
    return ByteTokenizer()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: each byte as a printable character (the alphabet of every byte-level BPE)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _byte_level(tokenizers: Any) -> Any:
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(list(BYTE_SPECIALS))  # ids 256, 257: after the 256 bytes
    return tok


def save_hf_tokenizer(tokenizer: Tokenizer, out_dir: str | os.PathLike, *, model_max_length: int | None = None) -> dict:
    """Write ``tokenizer`` as ``out_dir/tokenizer.json`` and ``tokenizer_config.json``; returns the special tokens
    (``{"bos_token": ..., "eos_token": ...}``) for the model's configs.

    Raises ValueError for a tokenizer with no Hugging Face form here (tiktoken files), naming the fix."""
    try:
        import tokenizers
    except ImportError:
        raise ImportError("exporting a tokenizer needs the `tokenizers` package: pip install tokenizers") from None
    if isinstance(tokenizer, ByteTokenizer):
        hf = _byte_level(tokenizers)
    elif isinstance(tokenizer, _HFTokenizer):
        hf = tokenizer._tok
    else:
        raise ValueError(
            f"the run's tokenizer ({type(tokenizer).__name__}) has no Hugging Face form in functitan yet; export with "
            "--tokenizer=none and convert it with transformers (e.g. TikTokenConverter), or train with a tokenizer.json"
        )
    specials = {"bos_token": hf.id_to_token(int(tokenizer.bos_id)), "eos_token": hf.id_to_token(int(tokenizer.eos_id))}
    if (
        hf.token_to_id(specials["bos_token"]) != tokenizer.bos_id
        or hf.token_to_id(specials["eos_token"]) != tokenizer.eos_id
    ):
        raise ValueError(f"the tokenizer's BOS / EOS ids ({tokenizer.bos_id}, {tokenizer.eos_id}) are not tokens of it")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "pad_token": specials["eos_token"],
        "add_bos_token": False,  # the ids a prompt trains on: the loader puts BOS only with data.add_bos
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        **({"model_max_length": model_max_length} if model_max_length else {}),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return specials
