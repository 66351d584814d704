"""The light tokenizer (policies/tokenizer.py) against transformers' AutoTokenizer on
the same directory: the chat-templated prompts of the text tasks, raw prompts, decodes
of random ids with special tokens, stop ids, and what falls back to transformers. The
rollout actor's setup on such a directory never imports transformers."""

from __future__ import annotations

import json
import dataclasses
import pathlib
import random
import shutil
import subprocess
import sys
import textwrap

import pytest
import transformers

from bench.async_vs_sync import STEP_BY_STEP
from policies.datasets import ArithmeticProblems
from policies.tasks import TextArithmetic, TextDataset
from policies.text_tasks import text_stop_token_ids
from policies.tokenizer import LIGHT_MODEL_TYPES, LightTokenizer, load_local_tokenizer, try_light_tokenizer
from tests.helpers import CHATML, build_byte_tokenizer, save_model

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHIPPED = [ROOT / "models" / "smollm2-tokenizer", ROOT / "models" / "smollm2-135m-instruct"]
TRAIN = str(ROOT / "examples" / "arithmetic_train.jsonl")


@pytest.fixture(scope="module")
def byte_dir(tmp_path_factory) -> pathlib.Path:
    """The text-task tests' tokenizer directory: byte-level BPE, ChatML in chat_template.jinja,
    ``<|im_start|>``/``<|im_end|>`` extra special tokens, and a generation config."""
    path = tmp_path_factory.mktemp("byte-tokenizer")
    build_byte_tokenizer().save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [256, 100]}))
    return path


@pytest.fixture(scope="module")
def saved_by_5_17(tmp_path_factory, byte_dir) -> pathlib.Path:
    """The byte-level BPE directory with the keys transformers 5.17 writes beside the named tokens
    (``tools.fetch_pretrained`` there): ``add_prefix_space``, ``legacy``, ``model_type``, the tokens' ids,
    and ``clean_up_tokenization_spaces`` true, which transformers ignores for a BPE model."""
    path = tmp_path_factory.mktemp("saved-by-5.17")
    shutil.copytree(byte_dir, path, dirs_exist_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    ids = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    added = {t["content"]: t["id"] for t in json.loads((path / "tokenizer.json").read_text())["added_tokens"]}
    config.update({f"{k}_id": {**ids, **added}[config[k] if isinstance(config[k], str) else config[k]["content"]]
                   for k in ("bos_token", "eos_token", "pad_token", "unk_token") if config.get(k) is not None})
    config.update(add_prefix_space=False, legacy=False, model_type="gpt2", clean_up_tokenization_spaces=True)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


BUILT = {"byte": "byte_dir", "saved-by-5.17": "saved_by_5_17"}  # directories the tests build: their fixtures


@pytest.fixture(scope="module", params=["byte", *(p.name for p in SHIPPED), "saved-by-5.17"])
def pair(request) -> tuple[pathlib.Path, LightTokenizer, object]:
    """(directory, light tokenizer, transformers' tokenizer) of one directory."""
    name = request.param
    path = request.getfixturevalue(BUILT[name]) if name in BUILT else ROOT / "models" / name
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"{path} is not here (python -m tools.fetch_pretrained)")
    light = try_light_tokenizer(path)
    assert isinstance(light, LightTokenizer), light
    return path, light, transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def arithmetic_prompts(n: int = 200) -> list[str]:
    """The text_arithmetic task's prompts, training and held-out, plain and step-by-step."""
    rng, out = random.Random(0), []
    for instruction in ("Answer with the number only.", STEP_BY_STEP, ""):
        for digits, operands, ops in ((1, 2, "+"), (2, 2, "+-"), (3, 3, "+-*"), (4, 2, "*")):
            problems = ArithmeticProblems(digits=digits, num_operands=operands, ops=ops, instruction=instruction)
            out += [problems.sample(rng).prompt for _ in range(n // 12)] + [r.prompt for r in problems.held_out(3)]
    return out


AWKWARD = ["", " ", "  leading and trailing  ", "tabs\tand\nnew\n\nlines\r\n", "naïve café – 数学 🙂",
           "a <|im_end|> inside, <|im_start|>user\nforged", "{{ not a template }} {% raw %}", "12345678901234567890"]


def chats(prompts: list[str]) -> list[list[dict]]:
    """User turns, with and without a system turn, multi-turn, and messages with extra and None fields."""
    out = [[{"role": "user", "content": p}] for p in prompts]
    out += [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": p}] for p in prompts[:20]]
    out += [[{"role": "user", "content": a}, {"role": "assistant", "content": b, "reasoning_content": "hm"},
             {"role": "user", "content": "and?", "name": None}] for a, b in zip(AWKWARD, reversed(AWKWARD))]
    return out


def test_chat_templated_prompts_render_and_encode_as_in_transformers(pair):
    _, light, full = pair
    conversations = chats(arithmetic_prompts() + AWKWARD)
    assert len(conversations) >= 200
    for gen in (True, False):
        texts = [light.apply_chat_template(c, tokenize=False, add_generation_prompt=gen) for c in conversations]
        assert texts == [full.apply_chat_template(c, tokenize=False, add_generation_prompt=gen) for c in conversations]
        assert light(texts, add_special_tokens=False)["input_ids"] == full(texts, add_special_tokens=False)["input_ids"]
    for c in conversations[:20] + conversations[-8:]:
        ids = full.apply_chat_template(c, add_generation_prompt=True, return_dict=False)
        assert light.apply_chat_template(c, add_generation_prompt=True, return_dict=False) == ids
        assert light.apply_chat_template(c, add_generation_prompt=True)["input_ids"] == ids
    assert light.apply_chat_template(conversations[:3], tokenize=False) == full.apply_chat_template(
        conversations[:3], tokenize=False)  # a batch of conversations


@dataclasses.dataclass
class _Message:
    role: str
    content: str
    name: str | None = None


class _Model:  # a pydantic-like message: model_dump() gives its dict
    def __init__(self, **fields) -> None:
        self.fields = fields

    def model_dump(self) -> dict:
        return dict(self.fields)


def test_dataclass_and_model_messages_render_as_in_transformers(pair):
    _, light, full = pair
    chat = [_Message("system", "Be brief."), _Model(role="user", content="2 + 3 =", name=None),
            {"role": "assistant", "content": "5"}]
    text = light.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == full.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    with pytest.raises(TypeError, match="should be dicts"):
        light.apply_chat_template(["not a message"], tokenize=False)


def test_raw_prompts_encode_as_in_transformers_with_and_without_special_tokens(pair):
    _, light, full = pair
    texts = arithmetic_prompts(48) + AWKWARD
    for special in (True, False):
        ids = full(texts, add_special_tokens=special)["input_ids"]
        assert light(texts, add_special_tokens=special)["input_ids"] == ids
        assert [light.encode(t, add_special_tokens=special) for t in texts] == [
            full.encode(t, add_special_tokens=special) for t in texts]
        assert light(texts[0], add_special_tokens=special) == dict(full(texts[0], add_special_tokens=special))


def test_random_ids_with_special_tokens_decode_as_in_transformers(pair):
    _, light, full = pair
    rng, vocab = random.Random(1), len(full)
    added = list(full.get_added_vocab().values())
    sequences = [[rng.choice(added) if rng.random() < 0.2 else rng.randrange(vocab) for _ in range(rng.randrange(40))]
                 for _ in range(300)] + [[], added, added[::-1] * 2]
    for skip in (False, True):
        assert [light.decode(s, skip_special_tokens=skip) for s in sequences] == [
            full.decode(s, skip_special_tokens=skip) for s in sequences]
    assert light.decode(added[0]) == full.decode(added[0])
    assert light.decode(sequences[:4]) == full.decode(sequences[:4])


def test_special_tokens_and_stop_ids_are_transformers(pair):
    path, light, full = pair
    assert text_stop_token_ids(light, str(path)) == text_stop_token_ids(full, str(path))
    assert light.get_added_vocab() == full.get_added_vocab()
    assert light.special_tokens_map == full.special_tokens_map
    assert light.chat_template == full.chat_template
    for name in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        assert getattr(light, name) == getattr(full, name), name
        assert getattr(light, name + "_id") == getattr(full, name + "_id"), name
    tokens = [*full.get_added_vocab(), "a", "Ġthe", "no-such-token-anywhere"]
    assert light.convert_tokens_to_ids(tokens) == full.convert_tokens_to_ids(tokens)
    with pytest.raises(AttributeError, match="policies/tokenizer.py"):
        light.save_pretrained  # noqa: B018 - outside the subset: an error naming where the subset is


def test_a_text_task_on_the_light_tokenizer_is_the_task_on_transformers(pair):
    path, light, full = pair
    for kwargs in ({}, {"instruction": STEP_BY_STEP}, {"system_prompt": "Be brief."}, {"chat_template": False}):
        a, b = (TextArithmetic(tok, model_path=str(path), **kwargs) for tok in (light, full))
        assert a.sample_prompts(random.Random(2), 64) == b.sample_prompts(random.Random(2), 64)
        assert a.eval_prompts(16) == b.eval_prompts(16) and a.stop_token_ids == b.stop_token_ids
    a, b = (TextDataset(tok, model_path=str(path), path=TRAIN) for tok in (light, full))
    assert a.sample_prompts(random.Random(3), 64) == b.sample_prompts(random.Random(3), 64)
    ids = list(a.stop_token_ids[:1]) + list(a._train[0].prompt_ids)
    assert a.decode(list(a._train[0].prompt_ids) + ids) == b.decode(list(b._train[0].prompt_ids) + ids)


TEMPLATES = {
    "features": """{%- set ns = namespace(n=0) -%}
{% for m in messages %}
  {%- if m['role'] == 'system' %}{% continue %}{% endif -%}
  {%- set ns.n = ns.n + 1 -%}
  {{ bos_token if loop.first else '' }}<|im_start|>{{ m.role }} #{{ ns.n }}
  {% generation %}{{ m.content | trim }}{% endgeneration %}
{{ {'k': m.content, 'u': 'é<>'} | tojson }} {{ dict(a=1) | tojson(indent=2) }}<|im_end|>
{% if loop.index > 5 %}{% break %}{% endif %}
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}""",
    "reasoning": "{% for m in messages %}{{ m.role }}:{{ m.get('thinking', '-') }}"
                 "|{{ m.get('reasoning_content', '-') }}|{{ m.content }}\n{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_template_features_render_as_in_transformers(name, tmp_path):
    build_byte_tokenizer(chat_template=TEMPLATES[name]).save_pretrained(tmp_path)
    light, full = try_light_tokenizer(tmp_path), transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "  x  "},
            {"role": "assistant", "content": "y", "reasoning": "because"}, {"role": "user", "content": "z"}]
    for gen in (True, False):
        assert light.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) == \
            full.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)


@pytest.mark.parametrize("template, error", [
    ("{{ raise_exception('System role not supported') }}", "TemplateError"),
    ("{% set ns = namespace(_x=1) %}", "SecurityError"),
    ("{{ messages.__class__ }}", None),  # the sandbox: renders nothing unsafe, as transformers' does
])
def test_template_errors_and_the_sandbox_are_transformers(template, error, tmp_path):
    build_byte_tokenizer(chat_template=template).save_pretrained(tmp_path)
    light, full = try_light_tokenizer(tmp_path), transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    chat = [{"role": "user", "content": "x"}]
    outcomes = []
    for tok in (light, full):
        try:
            outcomes.append(("ok", tok.apply_chat_template(chat, tokenize=False)))
        except Exception as e:  # noqa: BLE001 - the comparison is the point
            outcomes.append((type(e).__name__, str(e)))
    assert outcomes[0] == outcomes[1] and outcomes[0][0] == (error or "ok")


# -- what falls back --------------------------------------------------------------------------------------

def _edit(path: pathlib.Path, name: str, fn) -> None:
    data = json.loads((path / name).read_text()) if (path / name).exists() else {}
    (path / name).write_text(json.dumps(fn(data)))


FALLBACKS = {
    "no tokenizer.json": lambda p: (p / "tokenizer.json").rename(p / "elsewhere.json"),
    "tokenizer_class 'Qwen2Tokenizer'": lambda p: _edit(p, "tokenizer_config.json",
                                                        lambda c: {**c, "tokenizer_class": "Qwen2Tokenizer"}),
    "model_type 'qwen2'": lambda p: _edit(p, "config.json", lambda c: {"model_type": "qwen2"}),
    "['split_special_tokens'] set": lambda p: _edit(
        p, "tokenizer_config.json", lambda c: {**c, "split_special_tokens": True}),
    "['add_prefix_space'] set": lambda p: _edit(p, "tokenizer_config.json", lambda c: {**c, "add_prefix_space": True}),
    "eos_token_id 5 is not eos_token's id": lambda p: _edit(
        p, "tokenizer_config.json", lambda c: {**c, "eos_token_id": 5}),
    "keys ['image_token'] are not handled": lambda p: _edit(
        p, "tokenizer_config.json", lambda c: {**c, "image_token": "<|im_start|>"}),
    "not special added tokens": lambda p: _edit(p, "tokenizer_config.json", lambda c: {**c, "bos_token": "a"}),
    "added token 257 differs": lambda p: _edit(p, "tokenizer_config.json", lambda c: {**c, "added_tokens_decoder": {
        "257": {"content": "<|im_start|>", "lstrip": True, "rstrip": False, "normalized": False,
                "single_word": False, "special": True}}}),
    "named templates": lambda p: (p / "chat_template.json").write_text("{}"),
    "legacy special_tokens_map.json": lambda p: (p / "special_tokens_map.json").write_text("{}"),
}


@pytest.mark.parametrize("reason", sorted(FALLBACKS))
def test_a_directory_the_light_tokenizer_might_misread_falls_back_to_transformers(reason, byte_dir, tmp_path):
    path = tmp_path / "tok"
    shutil.copytree(byte_dir, path)
    FALLBACKS[reason](path)
    refusal = try_light_tokenizer(path)
    assert isinstance(refusal, str) and reason in refusal
    if reason == "no tokenizer.json":
        return  # nothing left that transformers reads either
    tok = load_local_tokenizer(path)
    assert type(tok).__module__.startswith("transformers.")
    prompt = [{"role": "user", "content": "What is 1 + 1?"}]
    assert tok.apply_chat_template(prompt, tokenize=False) == "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n"


def test_the_builtin_qwen2_tokenizer_falls_back_and_still_makes_a_raw_text_task():
    builtin = ROOT / "actors" / "assets" / "tiny-qwen2"
    assert "qwen2" in try_light_tokenizer(builtin)
    task = TextArithmetic(model_path=str(builtin), chat_template=False)
    assert type(task.tokenizer).__module__.startswith("transformers.")


@pytest.mark.parametrize("model_type", sorted(LIGHT_MODEL_TYPES))
@pytest.mark.parametrize("declared", ["PreTrainedTokenizerFast", "TokenizersBackend"])
def test_transformers_runs_a_plain_tokenizer_of_each_light_model_type_as_declared(model_type, declared, byte_dir,
                                                                                   tmp_path):
    """LIGHT_MODEL_TYPES holds: for these, AutoTokenizer builds no model-specific class."""
    shutil.copytree(byte_dir, tmp_path / "tok")
    _edit(tmp_path / "tok", "tokenizer_config.json", lambda c: {**c, "tokenizer_class": declared})
    _edit(tmp_path / "tok", "config.json", lambda c: {"model_type": model_type})
    assert isinstance(try_light_tokenizer(tmp_path / "tok"), LightTokenizer)
    full = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True)
    assert type(full).__name__ == "TokenizersBackend"


# -- the rollout actor's process -----------------------------------------------------------------------------

SETUP = textwrap.dedent("""
    import asyncio, functools, importlib, sys
    from actors.rollout import RolloutActor
    for module in RolloutActor.preload:  # what ProcessRuntime's process imports first
        importlib.import_module(module)
    from actors.engines import EngineConfig
    from contracts.rollout import SamplingParams
    from policies.tasks import make_task

    actor = RolloutActor(engine=EngineConfig(type="torch", device="cpu", max_num_seqs=2, max_model_len=64),
                         model_path=sys.argv[1], seed=0, sampling=SamplingParams(),
                         make_task=functools.partial(make_task, "text_arithmetic", model_path=sys.argv[1]),
                         max_response_tokens=8, partial_rollout=True, next_request=None, absorb=None, queue=None)
    asyncio.run(actor.setup())
    print(type(actor.task.tokenizer).__name__, sorted(m for m in sys.modules if m.split(".")[0] == "transformers"))
""")


def test_the_rollout_actor_setup_on_the_builtin_engine_never_imports_transformers(byte_dir, tmp_path):
    model = save_model("llama", tmp_path / "llama")
    for f in byte_dir.iterdir():
        shutil.copy(f, model)
    out = subprocess.run([sys.executable, "-c", SETUP, str(model)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "LightTokenizer []"
