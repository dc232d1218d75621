"""Text to token ids and back, for every model dualserve serves.

A `Tokenizer` wraps one `tokenizers.Tokenizer` (the Rust library that Hugging Face models ship
with) together with what serving needs around it: the bos/eos/pad ids, every id that ends a
generation, whether a prompt starts with bos, and the chat template. Three sources build one:

- a Hugging Face directory with `tokenizer.json`, loaded as it is;
- a Hugging Face directory with only a sentencepiece `tokenizer.model`: its pieces are rebuilt as
  a `tokenizers` model, as transformers' `LlamaTokenizer` does;
- the vocabulary embedded in a GGUF file under llama.cpp's `tokenizer.ggml.*` keys: byte-level BPE
  for `gpt2` vocabularies, sentencepiece-style BPE for `llama` ones.

Rebuilding every source as a `tokenizers` object, rather than calling sentencepiece at run time,
gives one code path for encoding, decoding and the parsing of special tokens inside text.

A `tokenizer.model` is read with the sentencepiece package's own schema (`sentencepiece_model_pb2`,
which needs protobuf): `SentencePieceProcessor` exposes the pieces, scores, types and ids but not
the model type or the normalizer's charsmap, which the rebuild needs. It replaced a hand-written
protobuf reader; on a synthetic 256k-piece model (5.3 MB) the package reads the pieces, scores
and types in 170 ms, the hand reader took 690 ms (32k pieces: 19 ms against 74 ms).

The vocabulary lives in Rust only (Gemma 3's: 97 MB); ``heap.trim_heap`` returns what parsing it freed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from dualserve.models.chat_template import ChatTemplate, ChatTemplateError, compile_chat_template
from dualserve.models.heap import trim_heap

if TYPE_CHECKING:
    import gguf

log = logging.getLogger(__name__)

# Token types, shared by sentencepiece's ModelProto.SentencePiece.Type and llama.cpp's
# `tokenizer.ggml.token_type` (gguf-py `TokenType`).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Tokens that end a turn in common chat formats. llama.cpp treats these as end-of-generation
# when they are in the vocabulary (src/llama-vocab.cpp, "auto-detect special tokens by text").
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "<｜end▁of▁sentence｜>",
)


class TokenizerError(ValueError):
    """A tokenizer source is missing, malformed or of a kind we cannot build."""


# ---------------------------------------------------------------------------------------------
# Pre-tokenizers for byte-level BPE, keyed by GGUF `tokenizer.ggml.pre`. The regexes are those of
# the models' own tokenizer.json files; llama.cpp's table is in src/llama-vocab.cpp
# (llm_tokenizer_bpe), which also says which families skip merges for whole-word tokens.

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreSplit:
    """How a byte-level BPE vocabulary cuts text before merging."""

    split: str | None = None  # regex whose matches become words; None = GPT-2's own regex
    digits: bool = False  # first cut every digit apart (StarCoder, SmolLM)
    ignore_merges: bool = False  # a word that is itself a token is taken whole (Llama 3)


_GPT2 = PreSplit()
_DIGITS = PreSplit(digits=True)
_LLAMA3 = PreSplit(_LLAMA3_SPLIT, ignore_merges=True)
_QWEN2 = PreSplit(_QWEN2_SPLIT)
PRE_SPLITS: dict[str, PreSplit] = {
    "default": _GPT2, "gpt-2": _GPT2, "mpt": _GPT2, "olmo": _GPT2, "phi-2": _GPT2, "jais": _GPT2,
    "smollm": _DIGITS, "starcoder": _DIGITS, "refact": _DIGITS, "codeshell": _DIGITS,
    "command-r": _DIGITS, "exaone": _DIGITS, "minerva-7b": _DIGITS,
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "falcon3": _LLAMA3,
    "pixtral": _LLAMA3, "dbrx": PreSplit(_LLAMA3_SPLIT), "smaug-bpe": PreSplit(_LLAMA3_SPLIT),
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "megrez": _QWEN2, "stablelm2": _QWEN2,
}
# llama.cpp prepends bos by default for these pre-tokenizers (llama_vocab::impl::load).
_BOS_BY_DEFAULT = {"llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"}


def byte_level_backend(vocab: Sequence[str], merges: Iterable[str], pre: str | None) -> Backend:
    """Byte-level BPE from a GGUF `gpt2` vocabulary: tokens, "left right" merges, pre-tokenizer."""
    spec = PRE_SPLITS.get(pre or "default")
    if spec is None:
        log.warning("unknown GGUF pre-tokenizer %r; splitting text as GPT-2 does", pre)
        spec = _GPT2
    ids: dict[str, int] = {}
    for i, token in enumerate(vocab):
        ids.setdefault(token, i)
    pairs = []
    for merge in merges:
        cut = merge.find(" ", 1)  # a left part may itself start with a space (llama.cpp does the same)
        pairs.append((merge[:cut], merge[cut + 1:]))
    backend = Backend(models.BPE(vocab=ids, merges=pairs, ignore_merges=spec.ignore_merges))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if spec.digits else []
    if spec.split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(spec.split), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    return backend


# ---------------------------------------------------------------------------------------------
# Sentencepiece-style vocabularies (GGUF `llama`, tokenizer.model).


@dataclass(frozen=True)
class SpmVocab:
    """The parts of a sentencepiece model that decide how text is tokenized."""

    pieces: list[str]
    scores: list[float]
    types: list[int]
    unigram: bool = False  # sentencepiece trainer's model_type UNIGRAM; else scored BPE
    add_dummy_prefix: bool = True  # "hello" is tokenized as " hello"
    remove_extra_whitespaces: bool = False
    charsmap: bytes | None = None  # precompiled normalization rules (nmt_nfkc and the like)
    special_ids: tuple[int | None, int | None, int | None, int | None] = (1, 2, None, 0)  # bos eos pad unk


def _merges_by_score(vocab: SpmVocab) -> list[tuple[str, str]]:
    """BPE merges equivalent to sentencepiece's and llama.cpp's SPM rule.

    Both repeatedly join the adjacent pair whose concatenation is the highest-scoring piece
    (llama.cpp src/llama-vocab.cpp, llm_tokenizer_spm_session). Ranking every split of every
    normal piece by that piece's score gives the same choices to a rank-ordered BPE.
    """
    index = {p: i for i, p in enumerate(vocab.pieces) if vocab.types[i] == NORMAL}
    ranked = []
    for piece, i in index.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in index and right in index:
                ranked.append((-vocab.scores[i], i, index[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def spm_backend(vocab: SpmVocab) -> Backend:
    """A `tokenizers` model that tokenizes as the sentencepiece model does.

    Same shape as transformers' LlamaTokenizer (models/llama/tokenization_llama.py): byte fallback,
    a Metaspace pre-tokenizer that prefixes the first word only, and a decoder that turns the
    meta-space back into spaces, bytes back into text and drops the prefix space. Where the
    references disagree we follow transformers: text that starts with a space gets no second
    one (sentencepiece adds it), and text right after a special token gets none (llama.cpp
    adds it).
    """
    unk_id = vocab.special_ids[3]
    byte_fallback = BYTE in vocab.types
    if vocab.unigram:
        model = models.Unigram(list(zip(vocab.pieces, vocab.scores)), unk_id, byte_fallback)
    else:
        ids: dict[str, int] = {}
        for i, piece in enumerate(vocab.pieces):
            ids.setdefault(piece, i)
        unk = vocab.pieces[unk_id] if unk_id is not None else None
        model = models.BPE(vocab=ids, merges=_merges_by_score(vocab), unk_token=unk,
                           fuse_unk=True, byte_fallback=byte_fallback)
    backend = Backend(model)
    norm = [normalizers.Precompiled(vocab.charsmap)] if vocab.charsmap else []
    if vocab.remove_extra_whitespaces:  # sentencepiece's normalizer.cc: trim ends, squeeze runs
        norm += [normalizers.Replace(Regex(r"^ +| +$"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if norm:
        backend.normalizer = normalizers.Sequence(norm)
    prepend = "first" if vocab.add_dummy_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_dummy_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _add_typed_tokens(backend: Backend, vocab: Sequence[str], types: Sequence[int]) -> None:
    """Control and unknown tokens become special tokens, user-defined ones plain added tokens.

    Either way they are matched whole in input text, as llama.cpp and transformers do.
    """
    special = [AddedToken(vocab[i], special=True, normalized=False)
               for i, t in enumerate(types) if t in (CONTROL, UNKNOWN)]
    plain = [AddedToken(vocab[i], special=False, normalized=False)
             for i, t in enumerate(types) if t == USER_DEFINED]
    if special:
        backend.add_special_tokens(special)
    if plain:
        backend.add_tokens(plain)


def read_spm_model(data: bytes) -> SpmVocab:
    """Parse a sentencepiece `tokenizer.model` (a serialized ModelProto).

    The sentencepiece package's own schema (`sentencepiece_model_pb2`, read with protobuf) gives
    the pieces with their scores and types, the trainer's model type and special ids, and the
    normalizer's rules. Unset fields take the proto's defaults (UNIGRAM, unk/bos/eos/pad ids
    0/1/2/-1, a dummy prefix, extra whitespace removed).
    """
    try:
        from google.protobuf.message import DecodeError
        from sentencepiece import sentencepiece_model_pb2
    except ImportError as e:
        raise TokenizerError("reading a sentencepiece tokenizer.model needs protobuf "
                             "(pip install protobuf)") from e
    try:
        proto = sentencepiece_model_pb2.ModelProto.FromString(data)
    except DecodeError as e:
        raise TokenizerError(f"malformed sentencepiece model: {e}") from e
    if not proto.pieces:
        raise TokenizerError("sentencepiece model has no pieces")
    pieces = [p.piece for p in proto.pieces]
    trainer, norm = proto.trainer_spec, proto.normalizer_spec

    def piece_id(i: int) -> int | None:
        return i if 0 <= i < len(pieces) else None

    identity = norm.name in ("", "identity")
    return SpmVocab(
        pieces, [p.score for p in proto.pieces], [p.type for p in proto.pieces],
        unigram=trainer.model_type == sentencepiece_model_pb2.TrainerSpec.UNIGRAM,
        add_dummy_prefix=norm.add_dummy_prefix, remove_extra_whitespaces=norm.remove_extra_whitespaces,
        charsmap=None if identity else (norm.precompiled_charsmap or None),
        special_ids=(piece_id(trainer.bos_id), piece_id(trainer.eos_id), piece_id(trainer.pad_id),
                     piece_id(trainer.unk_id)),
    )


# ---------------------------------------------------------------------------------------------
# Loading from the three sources.


def _gguf_value(reader: gguf.GGUFReader, key: str) -> Any:
    """A metadata value as plain Python (str, int, float, bool or list), or None if absent.

    Mirrors gguf-py's ReaderField.contents(), which older gguf releases lack.
    """
    field = reader.fields.get(key)
    if field is None:
        return None
    string, array = 8, 9  # gguf GGUFValueType.STRING / ARRAY
    if field.types[0] == array:
        if field.types[-1] == string:
            return [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
        return [v for i in field.data for v in field.parts[i].tolist()]
    if field.types[0] == string:
        return bytes(field.parts[-1]).decode("utf-8", "replace")
    return field.parts[-1].tolist()[0]


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _hf_chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    """The default chat template, from chat_template.jinja, chat_template.json or the config."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = _read_json(directory / "chat_template.json").get("chat_template")
    template = template or config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class Tokenizer:
    """One model's tokenizer: encode, decode, special ids and the chat template.

    Special-token strings inside text (like "<|im_start|>") are always parsed as those tokens,
    as transformers does; `add_special_tokens` only controls the bos/eos added around the text.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        stop_token_ids: Iterable[int] = (),
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.pad_token_id, self.unk_token_id = pad_token_id, unk_token_id
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.add_eos_token = add_eos_token and eos_token_id is not None
        self.chat_template = chat_template
        self._compiled: ChatTemplate | None = None
        added = backend.get_added_tokens_decoder()
        special = {i for i, tok in added.items() if tok.special}
        special |= {i for i in (bos_token_id, eos_token_id, pad_token_id, unk_token_id) if i is not None}
        self.all_special_ids: frozenset[int] = frozenset(special)
        ends = [i for i in (eos_token_id, *stop_token_ids) if i is not None]
        ends += [i for i in map(backend.token_to_id, END_OF_TURN_TOKENS) if i in special]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ends))

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """A Hugging Face model directory, or a .gguf file."""
        path = Path(path)
        if path.is_dir():
            return cls.from_hf_dir(path)
        if path.is_file() and path.suffix.lower() == ".gguf":
            import gguf

            return cls.from_gguf(gguf.GGUFReader(path))
        raise TokenizerError(f"{path} is neither a model directory nor a .gguf file")

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """The vocabulary embedded in an open GGUF file (llama.cpp's `tokenizer.*` keys)."""

        def meta(key: str) -> Any:
            return _gguf_value(reader, "tokenizer.ggml." + key)

        kind, tokens, pre = meta("model"), meta("tokens"), meta("pre")
        if not tokens:
            raise TokenizerError("GGUF file has no tokenizer.ggml.tokens")
        types = meta("token_type") or [NORMAL] * len(tokens)
        if kind == "gpt2":
            backend = byte_level_backend(tokens, meta("merges") or [], pre)
            add_bos_default = pre in _BOS_BY_DEFAULT
        elif kind == "llama":
            charsmap = meta("precompiled_charsmap")
            backend = spm_backend(SpmVocab(
                tokens, meta("scores") or [0.0] * len(tokens), types,
                add_dummy_prefix=meta("add_space_prefix") is not False,
                remove_extra_whitespaces=bool(meta("remove_extra_whitespaces")),
                charsmap=bytes(b & 0xFF for b in charsmap) if charsmap else None,
                special_ids=(None, None, None, meta("unknown_token_id"))))
            add_bos_default = True  # llama.cpp and transformers both default to bos for SPM
        else:
            raise TokenizerError(f"GGUF tokenizer model {kind!r} is not supported (gpt2 and llama are)")
        _add_typed_tokens(backend, tokens, types)
        trim_heap(collect=False)  # the build's temporaries (the module docstring)
        add_bos = meta("add_bos_token")
        return cls(
            backend, bos_token_id=meta("bos_token_id"), eos_token_id=meta("eos_token_id"),
            pad_token_id=meta("padding_token_id"), unk_token_id=meta("unknown_token_id"),
            stop_token_ids=[i for i in (meta("eot_token_id"), meta("eom_token_id")) if i is not None],
            add_bos_token=add_bos_default if add_bos is None else bool(add_bos),
            add_eos_token=bool(meta("add_eos_token")),
            chat_template=_gguf_value(reader, "tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, directory: str | Path) -> Tokenizer:
        """A Hugging Face model directory: tokenizer.json, else a sentencepiece tokenizer.model."""
        directory = Path(directory)
        config = _read_json(directory / "tokenizer_config.json")
        names = {**_read_json(directory / "special_tokens_map.json"), **config}
        spm_ids: tuple[int | None, ...] = (None, None, None, None)
        if (directory / "tokenizer.json").is_file():
            backend = Backend.from_file(str(directory / "tokenizer.json"))
        elif (directory / "tokenizer.model").is_file():
            vocab = read_spm_model((directory / "tokenizer.model").read_bytes())
            backend = spm_backend(vocab)
            _add_typed_tokens(backend, vocab.pieces, vocab.types)
            spm_ids = vocab.special_ids
            _add_config_tokens(backend, config.get("added_tokens_decoder") or {})
            names.setdefault("add_bos_token", True)  # LlamaTokenizer's default
        else:
            raise TokenizerError(f"{directory} has neither tokenizer.json nor tokenizer.model")
        trim_heap(collect=False)  # the parse's freed temporaries (the module docstring)

        def token_id(name: str, fallback: int | None) -> int | None:
            text = _token_text(names.get(name))
            found = backend.token_to_id(text) if text is not None else None
            return fallback if found is None else found

        names_ids = zip(("bos_token", "eos_token", "pad_token", "unk_token"), spm_ids)
        bos, eos, pad, unk = (token_id(name, fallback) for name, fallback in names_ids)
        generation_eos = _read_json(directory / "generation_config.json").get("eos_token_id")
        generation_eos = generation_eos if isinstance(generation_eos, list) else [generation_eos]
        add_bos, add_eos = names.get("add_bos_token"), names.get("add_eos_token")
        if add_bos is None or add_eos is None:
            inferred_bos, inferred_eos = _post_processor_adds(backend, bos, eos)
            add_bos = inferred_bos if add_bos is None else add_bos
            add_eos = inferred_eos if add_eos is None else add_eos
        return cls(
            backend, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, unk_token_id=unk,
            stop_token_ids=[i for i in generation_eos if isinstance(i, int)],
            add_bos_token=bool(add_bos), add_eos_token=bool(add_eos),
            chat_template=_hf_chat_template(directory, config),
        )

    # --- the API --------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> Backend:
        """The underlying `tokenizers.Tokenizer`."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # encode_batch releases the GIL while it works and encode does not: a long text tokenized
        # on a worker thread then leaves the server's event loop running (same ids either way).
        ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens:
            if self.add_bos_token:
                ids.insert(0, self.bos_token_id)
            if self.add_eos_token:
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """The raw token strings (byte-level or meta-space spelling), "" for unknown ids."""
        to_token = self._backend.id_to_token
        return [to_token(i) or "" for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render a conversation into the prompt text the model was trained on."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template")
        if self._compiled is None:
            self._compiled = compile_chat_template(self.chat_template)
        # Templates see the special tokens by name, as transformers passes its special_tokens_map.
        ids = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_id,
               "pad_token": self.pad_token_id, "unk_token": self.unk_token_id}
        specials = {name: self._backend.id_to_token(i) for name, i in ids.items() if i is not None}
        return self._compiled.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                     **{**specials, **extra})


def _add_config_tokens(backend: Backend, decoder: Mapping[str, Any]) -> None:
    """Tokens that tokenizer_config.json adds on top of a sentencepiece model, in id order."""
    for key in sorted(decoder, key=int):
        entry = decoder[key]
        text = _token_text(entry)
        if text is None or backend.token_to_id(text) is not None:
            continue
        flags = ("special", "normalized", "lstrip", "rstrip", "single_word")
        token = AddedToken(text, **{flag: bool(entry.get(flag)) for flag in flags})
        (backend.add_special_tokens if token.special else backend.add_tokens)([token])
        if backend.token_to_id(text) != int(key):
            log.warning("added token %r got id %s, tokenizer_config.json says %s",
                        text, backend.token_to_id(text), key)


def _post_processor_adds(backend: Backend, bos: int | None, eos: int | None) -> tuple[bool, bool]:
    """Whether tokenizer.json's post-processor puts bos before / eos after a single text."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    if len(full) <= len(plain):
        return False, False
    return (bos is not None and full[0] == bos and full[0] != plain[0],
            eos is not None and full[-1] == eos and full[-1] != plain[-1])
