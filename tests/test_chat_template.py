"""Tokenizer files as Hugging Face ships them, checked against transformers on the same folder.

Each folder is written by transformers itself (``save_pretrained`` puts the template in
``chat_template.jinja`` and named ones in ``additional_chat_templates/``, as current HF repos
have them) or by hand in an older layout, and ``HFTokenizer`` must render exactly what
``AutoTokenizer.apply_chat_template(tokenize=False)`` renders and tokenize it to the same ids
as ``apply_chat_template(tokenize=True)``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from strata_jax.api import InvalidRequestError
from strata_jax.chat_template import TokenizerFilesError
from strata_jax.models.config import ModelConfigError
from strata_jax.models.generation_config import GenerationDefaults
from strata_jax.tokenizer import HFTokenizer

transformers = pytest.importorskip("transformers")

# A ChatML template that also uses the special tokens, a kwarg, loop controls and the generation tag.
CHATML = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}{% continue %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n{% endif %}{% endif %}"
)
# A template that trims the message text (continue_final_message must then cut before the trimmed end).
TRIMMING = (
    "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)
TOOLS = "{% for m in messages %}TOOL-STYLE {{ m['role'] }}: {{ m['content'] | tojson }}\n{% endfor %}"
RAISING = (
    "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must be from the user') }}{% endif %}"
    "{{ messages[0]['content'] }}"
)

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": 'What is 2+2? Answer with "four" <b>bold</b> é.'},
    {"role": "assistant", "content": "Four.  "},
    {"role": "user", "content": "And 3+3?"},
]


def _write_tokenizer(folder: Path, chat_template: object | None = None) -> transformers.PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer with ChatML special tokens, saved by transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    raw.train_from_iterator(
        [m["content"] for m in CONVERSATION] * 20 + ["hello world assistant user system"] * 20, trainer
    )
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<s>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(folder)
    return tok


def _reference(folder: Path):
    return transformers.AutoTokenizer.from_pretrained(folder)


def _same_as_transformers(folder: Path, messages: list[dict], **kwargs) -> str:
    ours, ref = HFTokenizer(folder), _reference(folder)
    kwargs.setdefault(
        "add_generation_prompt", not kwargs.get("continue_final_message", False)
    )  # transformers' default is False
    names = {"chat_template": kwargs.pop("chat_template", None)}
    extra = kwargs.pop("chat_template_kwargs", {}) or {}
    text = ours.apply_chat_template(
        messages, chat_template=names["chat_template"], chat_template_kwargs=extra, **kwargs
    )
    expected = ref.apply_chat_template(
        messages, tokenize=False, chat_template=names["chat_template"], **kwargs, **extra
    )
    assert text == expected
    ref_ids = ref.apply_chat_template(
        messages, tokenize=True, chat_template=names["chat_template"], return_dict=False, **kwargs, **extra
    )
    assert ours.encode(text, add_special_tokens=False) == list(ref_ids)
    return text


def test_chat_template_jinja_saved_by_current_transformers(tmp_path):
    _write_tokenizer(tmp_path, CHATML)
    assert (tmp_path / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())  # the bug's cause
    text = _same_as_transformers(tmp_path, CONVERSATION, add_generation_prompt=True)
    assert text.startswith("<s><|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    no_prompt = _same_as_transformers(tmp_path, CONVERSATION, add_generation_prompt=False)
    assert not no_prompt.endswith("assistant\n")
    thinking_off = _same_as_transformers(
        tmp_path, CONVERSATION, add_generation_prompt=True, chat_template_kwargs={"enable_thinking": False}
    )
    assert thinking_off.endswith("<think>\n\n</think>\n")
    # the rendered prompt already holds its special tokens: encoding adds none
    ours = HFTokenizer(tmp_path)
    assert ours.encode(text, add_special_tokens=False)[0] == ours.bos_token_id


def test_named_templates_in_additional_chat_templates(tmp_path):
    _write_tokenizer(tmp_path, {"default": CHATML, "tool_use": TOOLS, "plain": TRIMMING})
    assert sorted(p.name for p in (tmp_path / "additional_chat_templates").iterdir()) == [
        "plain.jinja",
        "tool_use.jinja",
    ]
    assert _same_as_transformers(tmp_path, CONVERSATION).startswith("<s>")  # default
    assert _same_as_transformers(tmp_path, CONVERSATION, chat_template="tool_use").startswith("TOOL-STYLE system: ")
    _same_as_transformers(tmp_path, CONVERSATION, chat_template="plain", add_generation_prompt=True)
    ours = HFTokenizer(tmp_path)
    assert ours.chat_templates.names == ["default", "plain", "tool_use"]
    with pytest.raises(
        InvalidRequestError, match=r"one of this model's chat templates \['default', 'plain', 'tool_use'\]"
    ):
        ours.apply_chat_template(CONVERSATION, chat_template="{{ messages }}")  # a raw template is not a name


def test_templates_in_tokenizer_config_as_string_or_named_list(tmp_path):
    _write_tokenizer(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": TRIMMING}))
    _same_as_transformers(tmp_path, CONVERSATION, add_generation_prompt=True)
    config_file.write_text(
        json.dumps(
            {
                **config,
                "chat_template": [{"name": "tool_use", "template": TOOLS}, {"name": "default", "template": CHATML}],
            }
        )
    )
    _same_as_transformers(tmp_path, CONVERSATION)
    _same_as_transformers(tmp_path, CONVERSATION, chat_template="tool_use")
    # several templates, none named default: the request must choose (transformers refuses too)
    config_file.write_text(
        json.dumps({**config, "chat_template": [{"name": "a", "template": TOOLS}, {"name": "b", "template": TRIMMING}]})
    )
    with pytest.raises(InvalidRequestError, match="none is named 'default'"):
        HFTokenizer(tmp_path).apply_chat_template(CONVERSATION)
    _same_as_transformers(tmp_path, CONVERSATION, chat_template="b")


def test_jinja_file_takes_precedence_and_legacy_chat_template_json_is_read(tmp_path):
    _write_tokenizer(tmp_path, CHATML)
    config_file = tmp_path / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": TOOLS}))
    _same_as_transformers(
        tmp_path, CONVERSATION
    )  # chat_template.jinja wins over tokenizer_config.json, as in transformers
    assert HFTokenizer(tmp_path).chat_template == CHATML
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": TRIMMING}))  # the processors' legacy file
    ours = HFTokenizer(tmp_path)
    assert ours.chat_template == TRIMMING  # and it wins over tokenizer_config.json (vLLM reads it first too)
    assert ours.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True) == (
        '[SYSTEM] You are terse.<|im_end|>\n[USER] What is 2+2? Answer with "four" <b>bold</b> '
        "é.<|im_end|>\n[ASSISTANT] "
    )


@pytest.mark.parametrize("template", [CHATML, TRIMMING], ids=["keeps-spacing", "trims"])
def test_continue_final_message_matches_transformers(tmp_path, template):
    _write_tokenizer(tmp_path, template)
    prefilled = CONVERSATION + [{"role": "assistant", "content": "Six, because   "}]
    text = _same_as_transformers(tmp_path, prefilled, continue_final_message=True)
    assert text.rstrip().endswith("Six, because") and "<|im_end|>" not in text[text.rindex("Six") :]
    with pytest.raises(InvalidRequestError, match="Cannot set both"):
        HFTokenizer(tmp_path).apply_chat_template(prefilled, True, continue_final_message=True)


def test_template_errors_are_the_requests(tmp_path):
    _write_tokenizer(tmp_path, RAISING)
    ours = HFTokenizer(tmp_path)
    with pytest.raises(InvalidRequestError, match="the first message must be from the user"):
        ours.apply_chat_template(CONVERSATION)
    assert ours.apply_chat_template(CONVERSATION[1:]) == CONVERSATION[1]["content"]
    with pytest.raises(InvalidRequestError, match=r"may not set \['messages'\]"):
        ours.apply_chat_template(CONVERSATION[1:], chat_template_kwargs={"messages": []})
    (tmp_path / "chat_template.jinja").write_text("{{ ().__class__.__base__.__subclasses__() }}")
    with pytest.raises(InvalidRequestError, match="unsafe|access"):
        HFTokenizer(tmp_path).apply_chat_template(CONVERSATION)  # the sandbox holds


def test_malformed_chat_template_jinja_is_a_clear_error_at_load(tmp_path):
    _write_tokenizer(tmp_path, CHATML)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }\n{% endfor %}")
    with pytest.raises(TokenizerFilesError) as err:
        HFTokenizer(tmp_path)
    message = str(err.value)
    assert str(tmp_path / "chat_template.jinja") in message and "line 1" in message and "not valid Jinja" in message
    assert isinstance(err.value, ModelConfigError)  # the CLIs report these as one line
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(TokenizerFilesError, match="chat_template.jinja: not valid UTF-8"):
        HFTokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": [{"template": "x"}]}')
    with pytest.raises(TokenizerFilesError, match=r"tokenizer_config.json: chat_template\[0\] must be an object"):
        HFTokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerFilesError, match="tokenizer_config.json: not valid JSON"):
        HFTokenizer(tmp_path)


def test_special_tokens_from_tokenizer_config(tmp_path, caplog):
    ref = _write_tokenizer(tmp_path, CHATML)
    ours = HFTokenizer(tmp_path)
    assert ours.bos_token_id == ref.bos_token_id and ours.eos_token_ids == (ref.eos_token_id,)
    assert {k: ours.special_tokens[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")} == {
        k: str(getattr(ref, k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
    }
    sample = "hello world"
    assert ours.encode(sample) == ref(sample)["input_ids"]  # tokenizer.json decides what encode() adds
    assert ours.decode(ours.encode("<|im_start|>hello<|im_end|>", add_special_tokens=False)) == "hello"
    # add_bos_token in tokenizer_config.json: transformers >= 5 follows tokenizer.json; so do we, and say so
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "add_bos_token": True}))
    with caplog.at_level(logging.WARNING, logger="strata_jax.tokenizer"):
        ours = HFTokenizer(tmp_path)
    assert ours.encode(sample) == _reference(tmp_path)(sample)["input_ids"]
    assert "add_bos_token=True but tokenizer.json does not add BOS" in caplog.text
    # an added token whose id disagrees with tokenizer.json would shift every id: refused
    bad = {**config, "added_tokens_decoder": {"3": {"content": "<|im_start|>", "special": True}}}
    config_file.write_text(json.dumps(bad))
    with pytest.raises(TokenizerFilesError, match=r"added token '<\|im_start\|>' \(id 3\) has id 1 in tokenizer.json"):
        HFTokenizer(tmp_path)
    config_file.write_text(json.dumps({**config, "eos_token": "<|nope|>"}))
    with pytest.raises(TokenizerFilesError, match="eos_token '<|nope|>' is not in tokenizer.json's vocabulary"):
        HFTokenizer(tmp_path)


def test_generation_config_defaults_and_eos_lists(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": 1,
                "eos_token_id": [2, 7, 2],
                "do_sample": True,
                "temperature": 0.6,
                "top_p": 0.9,
                "top_k": 50,
                "repetition_penalty": 1.0,
                "max_new_tokens": 99,
            }
        )
    )
    gen = GenerationDefaults.from_folder(tmp_path)
    assert gen.eos_token_ids == (2, 7)
    # top_k 50 and repetition_penalty 1.0 are transformers' own defaults, not recommendations (as in vLLM)
    assert gen.sampling_defaults() == {"temperature": 0.6, "top_p": 0.9}
    assert gen.max_new_tokens == 99
    # what transformers itself reads from the same file
    ref = transformers.GenerationConfig.from_pretrained(tmp_path)
    assert (ref.temperature, ref.top_p, ref.eos_token_id) == (0.6, 0.9, [2, 7, 2])
    assert GenerationDefaults.from_folder(tmp_path / "missing") == GenerationDefaults()
    (tmp_path / "generation_config.json").write_text('{"temperature": "hot"}')
    with pytest.raises(ModelConfigError, match="generation_config.json: temperature must be a number"):
        GenerationDefaults.from_folder(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"top_p": 0}')
    with pytest.raises(ModelConfigError, match=r"top_p=0 is outside \(0.0, 1.0\]"):
        GenerationDefaults.from_folder(tmp_path)
