"""A text task's tokenizer without transformers: ``tokenizer.json`` through the
``tokenizers`` library, the chat template through jinja2 in the sandbox
transformers renders chat templates in.

Why: ``transformers.AutoTokenizer`` pulls transformers' tokenization and
configuration code and torch (seconds per process, more with a cold page
cache), while a text task needs only to render prompts (chat template, then
encode), decode responses and know its stop ids. A rollout actor on the
built-in engine then never imports transformers; nor does the driver for its task.

:func:`try_light_tokenizer` is the one place that decides. It answers the light
tokenizer only where it gives transformers' results exactly: a ``tokenizer.json``
the directory declares as the plain fast tokenizer (``tokenizer_class``
``PreTrainedTokenizerFast`` / ``TokenizersBackend``, which transformers runs as
the file says) of a model type in :data:`LIGHT_MODEL_TYPES` (or of no model),
special tokens that are special added tokens of the file, and only the
``tokenizer_config.json`` keys it knows (those transformers 5.17 saves too: ids
that must be the named tokens' own, ``add_prefix_space`` false over a
pre-tokenizer that adds none, ``clean_up_tokenization_spaces``, which transformers
ignores for a BPE model). Anything else (a model-specific class such as
``Qwen2Tokenizer``, which rebuilds its pipeline; cleanup of a non-BPE model or
split options; named chat templates; legacy special-token files) gets a reason,
and :func:`load_local_tokenizer` falls back to ``AutoTokenizer``.

:class:`LightTokenizer` has exactly the part of a transformers tokenizer the
project calls (tests/test_tokenizer_light.py holds it equal to transformers'):
``apply_chat_template``, ``__call__``, ``encode``, ``decode``, ``get_added_vocab``,
``convert_tokens_to_ids``, ``chat_template``, ``special_tokens_map`` and the named
special tokens and their ids (``eos_token_id``, ``pad_token_id``, ...).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import pathlib
import sys
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any, cast

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

__all__ = ["LIGHT_MODEL_TYPES", "LightTokenizer", "load_local_tokenizer", "try_light_tokenizer"]

log = logging.getLogger(__name__)

#: Model types (``config.json``) for which transformers runs a declared plain fast
#: tokenizer as its ``tokenizer.json`` says (checked against transformers by the tests).
#: Others, e.g. ``qwen2`` (transformers forces ``Qwen2Tokenizer``) or ``mistral`` (it
#: may patch the pre-tokenizer), fall back.
LIGHT_MODEL_TYPES = frozenset({"llama", "gpt2", "gpt_neox", "olmo2"})
_PLAIN_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
#: Transformers' named special tokens: the template sees those that are set.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json keys that change nothing here, or that are checked below; transformers 5.17
# saves the last five too (``legacy`` and ``model_type`` mean nothing to a plain fast tokenizer)
_CONFIG_KEYS = frozenset({"backend", "tokenizer_class", "chat_template", "model_max_length", "added_tokens_decoder",
                          "extra_special_tokens", "additional_special_tokens", "clean_up_tokenization_spaces",
                          "split_special_tokens", "add_bos_token", "add_eos_token", "padding_side",
                          "truncation_side", "model_input_names", *SPECIAL_TOKENS,
                          "add_prefix_space", "legacy", "model_type", *(f"{k}_id" for k in SPECIAL_TOKENS)})
_OFF_KEYS = ("clean_up_tokenization_spaces", "split_special_tokens", "add_bos_token", "add_eos_token",
             "add_prefix_space")
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' aliases, the first one standard


def load_local_tokenizer(model_dir: str | pathlib.Path) -> object:
    """The tokenizer saved in ``model_dir``, from local files only: a
    :class:`LightTokenizer` where :func:`try_light_tokenizer` allows one, else
    ``transformers.AutoTokenizer`` (whose errors propagate)."""
    light = try_light_tokenizer(model_dir)
    if isinstance(light, LightTokenizer):
        return light
    log.info("tokenizer of %s through transformers: %s", model_dir, light)
    import transformers  # seconds to import: only a directory the light tokenizer cannot read pays it

    return transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def try_light_tokenizer(model_dir: str | pathlib.Path) -> LightTokenizer | str:
    """The light tokenizer of ``model_dir``, or why it might differ from transformers'
    (a sentence naming the file and key). The rules are in the module docstring."""
    d = pathlib.Path(model_dir)
    if not (d / "tokenizer.json").is_file():
        return "no tokenizer.json"
    try:
        config = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
        model = json.loads((d / "config.json").read_text(encoding="utf-8")) if (d / "config.json").is_file() else {}
    except (OSError, ValueError) as e:
        return f"tokenizer_config.json or config.json unreadable ({type(e).__name__}: {e})"
    if not isinstance(config, dict) or not isinstance(model, dict):
        return "tokenizer_config.json or config.json is not a JSON object"
    if config.get("tokenizer_class") not in _PLAIN_CLASSES or config.get("backend", "tokenizers") != "tokenizers":
        return f"tokenizer_config.json: tokenizer_class {config.get('tokenizer_class')!r} is not a plain fast tokenizer"
    if unknown := sorted(set(config) - _CONFIG_KEYS):
        return f"tokenizer_config.json: keys {unknown} are not handled here"
    if (d / "config.json").is_file() and model.get("model_type") not in LIGHT_MODEL_TYPES:
        return f"config.json: model_type {model.get('model_type')!r} is not in LIGHT_MODEL_TYPES"
    if (d / "chat_template.json").exists() or (d / "additional_chat_templates").exists():
        return "chat_template.json or additional_chat_templates/ (named templates)"
    if "added_tokens_decoder" not in config and any((d / f).exists() for f in ("special_tokens_map.json",
                                                                               "added_tokens.json")):
        return "legacy special_tokens_map.json / added_tokens.json"
    template = (d / "chat_template.jinja").read_text(encoding="utf-8") if (d / "chat_template.jinja").is_file() \
        else config.get("chat_template")
    if template is not None and not isinstance(template, str):
        return "tokenizer_config.json: named chat templates"
    if tuple(int(x) for x in jinja2.__version__.split(".")[:3] if x.isdigit()) < (3, 1, 6):
        return f"jinja2 {jinja2.__version__} < 3.1.6 (transformers refuses it)"
    backend = Tokenizer.from_file(str(d / "tokenizer.json"))
    if backend.truncation is not None or backend.padding is not None:
        return "tokenizer.json sets truncation or padding"
    bpe = type(backend.model).__name__ == "BPE"  # transformers 5 ignores the clean-up of a BPE model's decodes
    if on := [k for k in _OFF_KEYS if config.get(k) and not (k == "clean_up_tokenization_spaces" and bpe)]:
        return f"tokenizer_config.json: {on} set"
    pre = json.dumps(json.loads(backend.to_str()).get("pre_tokenizer")).replace(" ", "")
    if config.get("add_prefix_space") is False and '"add_prefix_space":true' in pre:
        return "tokenizer_config.json: add_prefix_space false over a pre-tokenizer that adds one"
    for name in SPECIAL_TOKENS:  # ids saved beside the named tokens must be theirs
        if f"{name}_id" in config and (config[f"{name}_id"] is None) != (config.get(name) is None) or (
                config.get(f"{name}_id") is not None and backend.token_to_id(_content(config[name]))
                != config[f"{name}_id"]):
            return f"tokenizer_config.json: {name}_id {config[f'{name}_id']!r} is not {name}'s id"
    added = backend.get_added_tokens_decoder()  # id -> AddedToken
    for idx, token in (config.get("added_tokens_decoder") or {}).items():
        mine = added.get(int(idx))
        if not isinstance(token, dict) or mine is None or any(
                token.get(f) != getattr(mine, f) for f in _ADDED_TOKEN_FIELDS):
            return f"tokenizer_config.json: added token {idx} differs from tokenizer.json's"
    extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
    if not isinstance(extra, list):
        return "tokenizer_config.json: extra_special_tokens is not a list"
    named = {k: _content(config[k]) for k in SPECIAL_TOKENS if config.get(k) is not None}
    special = {t.content for t in added.values() if t.special}
    if missing := [t for t in [*named.values(), *map(_content, extra)] if t not in special]:
        return f"special tokens {missing} are not special added tokens of tokenizer.json"
    return LightTokenizer(backend, named, template)


def _content(token: object) -> str:
    return token["content"] if isinstance(token, dict) else str(token)


class LightTokenizer:
    """A ``tokenizers.Tokenizer`` with a chat template and named special tokens:
    the subset of a transformers fast tokenizer a text task calls, same results
    (no padding or truncation; batches are lists). Built by :func:`try_light_tokenizer`."""

    def __init__(self, backend: Tokenizer, special_tokens: dict[str, str], chat_template: str | None) -> None:
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = False  # transformers' split_special_tokens=False
        self.backend, self.chat_template = backend, chat_template
        self.special_tokens_map = {k: special_tokens[k] for k in SPECIAL_TOKENS if k in special_tokens}

    def __getattr__(self, name: str) -> Any:
        # bos_token, eos_token_id, ...: the named special tokens (None when unset), as transformers has them
        base = name.removesuffix("_id")
        if base not in SPECIAL_TOKENS:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r} (policies/tokenizer.py)")
        token = self.__dict__.get("special_tokens_map", {}).get(base)
        return token if token is None or base == name else self.convert_tokens_to_ids(token)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """Token ids; a token not in the vocabulary gets ``unk_token_id``."""
        if not isinstance(tokens, str):
            return [self._token_id(t) for t in tokens]
        return self._token_id(tokens)

    def _token_id(self, token: str) -> int | None:
        idx = self.backend.token_to_id(token)
        unk = self.special_tokens_map.get("unk_token")
        return idx if idx is not None or unk is None else self.backend.token_to_id(unk)

    def get_added_vocab(self) -> dict[str, int]:
        """The added tokens (special ones included): content -> id, by id."""
        return {t.content: i for i, t in sorted(self.backend.get_added_tokens_decoder().items())}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict[str, list]:
        """``{"input_ids", "attention_mask"}`` of a text, or of each text of a list."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        batch = [e.ids for e in self.backend.encode_batch(list(text), add_special_tokens=add_special_tokens)]
        return {"input_ids": batch, "attention_mask": [[1] * len(x) for x in batch]}

    def decode(self, token_ids: int | list[int] | list[list[int]],
               skip_special_tokens: bool = False) -> str | list[str]:
        """The text of ``token_ids`` (a list of them: a list of texts)."""
        if hasattr(token_ids, "tolist"):  # a tensor or an array, as transformers takes them
            token_ids = token_ids.tolist()
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if token_ids and isinstance(token_ids[0], (list, tuple)):
            return cast(list[str], [self.decode(ids, skip_special_tokens) for ids in token_ids])
        return self.backend.decode([int(i) for i in cast(list[int], token_ids)], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation: list, *, add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = True) -> Any:
        """The conversation (a list of message dicts; or a list of conversations)
        rendered by the chat template: the text (``tokenize=False``), else its ids
        encoded without added special tokens (``return_dict``: as ``__call__`` returns them)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        batched = isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages")
        template = _compile(self.chat_template)
        texts = [template.render(messages=_template_messages(chat), tools=None, documents=None,
                                 add_generation_prompt=add_generation_prompt, **self.special_tokens_map)
                 for chat in (conversation if batched else [conversation])]
        text = texts if batched else texts[0]
        if not tokenize:
            return text
        out = self(text, add_special_tokens=False)
        return out if return_dict else out["input_ids"]


# -- the chat template, as transformers renders it (utils/chat_template_utils.py) ---------------------------

class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask markers):
    rendered as their body; no mask is kept."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: object, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None,
            sort_keys: bool = False) -> str:
    # not jinja's own: that one escapes HTML characters
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateDict:
    """``dict`` in a template, without attribute access to the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace`` in a template, refusing underscore names (CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick: namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: object) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute.")


@functools.lru_cache(maxsize=16)
def _compile(chat_template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=_TemplateDict(), namespace=_TemplateNamespace)
    return env.from_string(chat_template)


def _template_messages(chat: Iterable[object]) -> list[dict]:
    """The messages as the template sees them: dicts without None values, rebuilt of
    plain data, reasoning under its aliases."""
    messages = []
    for given in getattr(chat, "messages", chat):
        message = _plain(given)
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {given!r}.")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        messages.append(message if reasoning is None else
                        {"thinking": reasoning, **message, "reasoning_content": reasoning})
    return messages


def _plain(value: object) -> object:
    """Only JSON types reach the sandbox; anything else becomes ``"<TypeName>"``."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (str, int, float):
        if isinstance(value, kind):
            return kind(value) if kind is not str else str.__str__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    numpy = sys.modules.get("numpy")  # a numpy scalar exists only where numpy is imported
    if numpy is not None and isinstance(value, numpy.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(getattr(value, "model_dump")())
    return f"<{type(value).__name__}>"
