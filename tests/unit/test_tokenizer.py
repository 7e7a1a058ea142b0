"""The tokenizer wrapper: HF-identical encode/decode and chat template, eos ids, incremental detokenization."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trnd.model import maker
from trnd.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog. Prefill is compute-bound; decode is memory-bound.",
    "def softmax(x):\n    m = max(x)\n    return [math.exp(v - m) for v in x]\n",
    "Grüße aus Köln! Ça va? ¿Qué tal? Ελληνικά και русский текст.",
    "你好，世界！大语言模型的推理服务。こんにちは、元気ですか？안녕하세요 반갑습니다.",
    "Emoji: 👨‍👩‍👧‍👦 🇫🇷 👍🏽 🚀🔥 and math ∑ᵢ aᵢ ≤ √2 · π ≈ 3.14 ⇒ ∞",
    "<|im_start|>user\nHi there 🙂<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>",
    "   leading spaces, trailing tabs\t\t\n\n\nand blank lines  ",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "Explain paging in one line.\nThanks 🙏"}],
    [{"role": "user", "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Part two."}]}],
    [{"role": "system", "content": [{"type": "text", "text": "sys"}]},
     {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "see"}]},
     {"role": "assistant", "content": ""}],
]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return maker.make_model(tmp_path_factory.mktemp("tok") / "tiny", "tiny", "qwen3")


@pytest.fixture(scope="session")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="session")
def hf_tok(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def _copy(model_dir: Path, dst: Path) -> Path:
    shutil.copytree(model_dir, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    return dst


@pytest.mark.parametrize("text", TEXTS)
def test_roundtrip_and_same_ids_as_transformers(tok, hf_tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert ids == hf_tok(text)["input_ids"] == tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_special_tokens_and_ids(tok):
    assert tok.vocab_size == 1024
    assert tok.eos_token_ids == [maker.IM_END, maker.ENDOFTEXT]
    assert tok.bos_token_id is None
    assert tok.all_special_ids == [0, 1, 2]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == maker.IM_START and ids[-1] == maker.IM_END
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, messages, add_generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours == theirs
    assert ours.startswith("<|im_start|>")
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_template_is_chatml(tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}]
    assert tok.apply_chat_template(msgs) == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
                                            "<|im_start|>assistant\n")


def test_custom_template_sees_hf_variables_and_helpers(tok, hf_tok, model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "custom")
    template = ("{% for m in messages %}{{ m | tojson }}|{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}"
                "[{{ bos_token }}][{{ eos_token }}][{{ pad_token }}][{{ extra_var }}]"
                "{% if add_generation_prompt %}GO{% endif %}"
                "{% if messages | length > 3 %}{{ raise_exception('too many: ' ~ messages | length) }}{% endif %}")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(d)
    ours = Tokenizer.from_dir(d)
    msgs = [{"role": "user", "content": "<b>&'é"}]
    expect = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, extra_var="X")
    assert ours.apply_chat_template(msgs, extra_var="X") == expect
    assert '"<b>&\'é"' in expect and "[][<|im_end|>][<|endoftext|>][X]GO" in expect
    import jinja2
    with pytest.raises(jinja2.TemplateError, match="too many: 4"):
        ours.apply_chat_template(msgs * 4)


def test_template_whitespace_control_matches_transformers(model_dir, tmp_path):
    """trim_blocks + lstrip_blocks: indented block tags on their own lines leave no whitespace behind."""
    d = _copy(model_dir, tmp_path / "ws")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}\n    {% if m.role == 'user' %}\nU: {{ m.content }}\n"
                            "    {% else %}\nA: {{ m.content }}\n    {% endif %}\n{% endfor %}\n"
                            "{% if add_generation_prompt %}\n  A:{% endif %}")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    from transformers import AutoTokenizer
    msgs = CONVERSATIONS[1][1:3]
    ours = Tokenizer.from_dir(d).apply_chat_template(msgs)
    assert ours == AutoTokenizer.from_pretrained(d).apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours == "U: Hi!\nA: Hello.\n  A:"


def test_chat_template_from_jinja_file_and_missing(model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "jinja")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json.*chat_template"):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}])
    (d / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.role }}>{% endfor %}")
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}]) == "<user>"


def test_eos_ids_are_the_union_of_generation_config_and_tokenizer_config(model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "eos")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": maker.ENDOFTEXT}))
    assert Tokenizer.from_dir(d).eos_token_ids == [maker.ENDOFTEXT, maker.IM_END]
    (d / "generation_config.json").unlink()  # falls back to config.json's eos_token_id
    assert Tokenizer.from_dir(d).eos_token_ids == [maker.IM_END]


def test_bos_is_added_once_when_configured(model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "bos")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.update(add_bos_token=True, bos_token={"content": "<|endoftext|>", "special": True})
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer.from_dir(d)
    assert t.bos_token_id == maker.ENDOFTEXT
    plain = t.encode("hello", add_special_tokens=False)
    assert t.encode("hello") == [maker.ENDOFTEXT] + plain
    assert t.encode("<|endoftext|>hello") == [maker.ENDOFTEXT] + plain


def test_errors_name_the_file(model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nothing" / "tokenizer.json")):
        Tokenizer.from_dir(tmp_path / "nothing")
    d = _copy(model_dir, tmp_path / "bad")
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_dir(d)
    (d / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(d)


def test_runtime_does_not_import_transformers():
    code = "import sys, trnd.model.tokenizer; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def _stream(tok, prompt, out, skip=True):
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    pieces = [d.push(t) for t in out]
    return pieces, d.flush()


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(data=st.data())
def test_detokenizer_on_slices_of_real_text(tok, data):
    """Prompt/output cut at random token positions of real text: the stream is decode(output), and no piece
    ever carries U+FFFD for a character still being completed."""
    text = data.draw(st.sampled_from(TEXTS + ["".join(TEXTS)]))
    ids = tok.encode(text)
    k = data.draw(st.integers(0, len(ids)))
    e = data.draw(st.integers(k, len(ids)))
    # Cut the prompt on a character boundary (the invariant's precondition); the output may end anywhere.
    while k and tok.decode(ids[:k], skip_special_tokens=False).endswith("\ufffd"):
        k -= 1
    skip = data.draw(st.booleans())
    prompt, out = ids[:k], ids[k:e]
    pieces, tail = _stream(tok, prompt, out, skip)
    assert "".join(pieces) + tail == tok.decode(out, skip_special_tokens=skip)
    assert not any("\ufffd" in p for p in pieces)
    if e == len(ids) or not tok.decode(ids[:e]).endswith("\ufffd"):
        assert tail == ""


@SETTINGS
@given(data=st.data())
def test_detokenizer_on_arbitrary_ids(tok, data):
    """Random ids (specials included), as a random-weight model emits them: nothing lost or duplicated."""
    prompt = tok.encode(data.draw(st.sampled_from(TEXTS)))
    out = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
    skip = data.draw(st.booleans())
    pieces, tail = _stream(tok, prompt, out, skip)
    assert "".join(pieces) + tail == tok.decode(out, skip_special_tokens=skip)


def test_detokenizer_keeps_word_spaces_for_metaspace_tokenizers(tmp_path):
    """SentencePiece-style decoders drop the first token's leading space; prompt context keeps it."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    hf.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    hf.train_from_iterator(["Hello world, the wide world says hello again."],
                           trainers.BpeTrainer(vocab_size=120, show_progress=False))
    hf.save(str(tmp_path / "tokenizer.json"))
    t = Tokenizer.from_dir(tmp_path)
    ids = t.encode("Hello world, the wide world says hello again.")
    for k in range(1, len(ids)):
        pieces, tail = _stream(t, ids[:k], ids[k:])
        full, head = t.decode(ids), t.decode(ids[:k])
        assert "".join(pieces) + tail == full[len(head):]
    assert t.decode(ids[1:2]).strip() == t.decode(ids[1:2])  # alone, a token loses its space


def test_detokenizer_holds_back_split_characters(tok):
    out = tok.encode("🚀")
    assert len(out) > 1  # the tiny vocabulary splits the 4-byte emoji
    pieces, tail = _stream(tok, tok.encode("go "), out)
    assert pieces[:-1] == [""] * (len(out) - 1) and pieces[-1] == "🚀" and tail == ""
