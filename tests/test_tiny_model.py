"""The tiny-model factory, its tokenizer, the default-model cache and the `splitserve` CLI."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, KimiLinearForCausalLM

from cli import main as cli
from splitserve.default_model import DEFAULT_MODEL_NAME, default_model_path
from splitserve.tiny_model import PRESETS, make_tiny_model, num_checkpoint_elements
from splitserve.tokenizer_files import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, build_tokenizer

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Where do the boats come in?"},
    {"role": "assistant", "content": "At the harbour, after six."},
    {"role": "user", "content": [{"type": "text", "text": "And then?"}]},
]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tiny_model(tiny_path: Path) -> KimiLinearForCausalLM:
    return KimiLinearForCausalLM.from_pretrained(tiny_path).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_path: Path):
    return AutoTokenizer.from_pretrained(tiny_path)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_preset_loads_with_transformers_as_a_hybrid_moe_model(
    tiny_model: KimiLinearForCausalLM, tokenizer
) -> None:
    config = tiny_model.config
    assert config.model_type == "kimi_linear"
    assert {"linear_attention", "full_attention"} <= set(config.layer_types)
    assert config.mlp_layer_types[0] == "dense"
    assert set(config.mlp_layer_types[1:]) == {"sparse"}
    assert config.num_key_value_heads == config.num_attention_heads
    assert config.vocab_size == len(tokenizer)
    assert 1_000_000 <= tiny_model.num_parameters() <= 2_000_000
    assert tokenizer.convert_ids_to_tokens(config.pad_token_id) == PAD_TOKEN
    assert tokenizer.convert_ids_to_tokens(config.bos_token_id) == BOS_TOKEN
    assert tokenizer.convert_ids_to_tokens(config.eos_token_id) == EOS_TOKEN
    assert tiny_model.generation_config.eos_token_id == config.eos_token_id


def test_same_seed_gives_identical_bytes_and_another_seed_different_weights(
    tiny_path: Path, tmp_path: Path
) -> None:
    again = make_tiny_model(tmp_path / "again", seed=0)
    other = make_tiny_model(tmp_path / "other", seed=1)
    assert _sha256(again / "model.safetensors") == _sha256(tiny_path / "model.safetensors")
    assert _sha256(again / "tokenizer.json") == _sha256(tiny_path / "tokenizer.json")
    base, changed = load_file(tiny_path / "model.safetensors"), load_file(other / "model.safetensors")
    assert base.keys() == changed.keys()
    assert all(not torch.equal(base[name], changed[name]) for name in base)


def test_every_tensor_is_randomized_including_router_bias(tiny_path: Path) -> None:
    weights = load_file(tiny_path / "model.safetensors")
    biases = [tensor for name, tensor in weights.items() if name.endswith("e_score_correction_bias")]
    assert len(biases) == PRESETS["tiny"]["mlp_layer_types"].count("sparse")
    for bias in biases:
        assert bias.abs().min() > 0 and bias.unique().numel() == bias.numel()
    for name, tensor in weights.items():
        # No constant tensors (untouched norms are all ones, untouched routers all zeros).
        assert tensor.numel() == 1 or tensor.std() > 0, name


def test_config_overrides_reach_the_checkpoint(tmp_path: Path) -> None:
    path = make_tiny_model(
        tmp_path / "m",
        num_hidden_layers=3,
        layer_types=["full_attention", "linear_attention", "full_attention"],
        q_lora_rank=24,
        linear_conv_kernel_dim=3,
    )
    config = json.loads((path / "config.json").read_text())
    assert config["layer_types"] == ["full_attention", "linear_attention", "full_attention"]
    assert config["mlp_layer_types"] == ["dense", "sparse", "sparse"]
    assert (config["q_lora_rank"], config["linear_conv_kernel_dim"]) == (24, 3)
    model = KimiLinearForCausalLM.from_pretrained(path)
    assert model.model.layers[0].self_attn.q_a_proj.out_features == 24


def test_unknown_preset_is_rejected_with_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bench-10m"):
        make_tiny_model(tmp_path / "m", preset="huge")


def test_chat_template_renders_the_same_in_transformers_and_plain_jinja(tiny_path: Path, tokenizer) -> None:
    template = json.loads((tiny_path / "tokenizer_config.json").read_text())["chat_template"]
    for add_generation_prompt in (False, True):
        via_transformers = tokenizer.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        via_jinja = (
            jinja2.Environment()
            .from_string(template)
            .render(messages=MESSAGES, add_generation_prompt=add_generation_prompt)
        )
        assert via_transformers == via_jinja
    assert via_jinja == (
        "<|im_system|>system<|im_middle|>You are terse.<|im_end|>"
        "<|im_user|>user<|im_middle|>Where do the boats come in?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>At the harbour, after six.<|im_end|>"
        "<|im_user|>user<|im_middle|>And then?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )


def test_tokenizer_round_trips_text_and_keeps_markers_whole(tokenizer) -> None:
    text = "Café at 06:45 — 12.5 kg of crab!\n\tdef f(x): return x ** 2  # ✓ 日本"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] != tokenizer.bos_token_id  # no implicit BOS: the template owns the framing
    assert tokenizer.decode(ids) == text
    marked = "<|im_user|>user<|im_middle|>hi<|im_end|>"
    ids = tokenizer(marked)["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert (tokens[0], tokens[-1]) == ("<|im_user|>", "<|im_end|>")
    assert tokens.count("<|im_middle|>") == 1
    assert tokenizer.decode(ids) == marked


def test_tokenizer_training_is_deterministic() -> None:
    assert build_tokenizer().to_str() == build_tokenizer().to_str()
    assert build_tokenizer().get_vocab_size() == 2048


def test_greedy_generate_runs_and_varies(tiny_model: KimiLinearForCausalLM, tokenizer) -> None:
    prompt = tokenizer("The fishing boats came in", return_tensors="pt")
    with torch.no_grad():
        out = tiny_model.generate(**prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    new_tokens = out[0, prompt["input_ids"].shape[1] :].tolist()
    assert len(new_tokens) == 8
    assert len(set(new_tokens)) > 1


def test_logits_have_no_near_ties_on_most_positions(tiny_model: KimiLinearForCausalLM) -> None:
    input_ids = torch.randint(
        0, tiny_model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        logprobs = tiny_model(input_ids).logits.log_softmax(-1)
    top2 = logprobs.topk(2, dim=-1).values
    margins = (top2[..., 0] - top2[..., 1]).flatten()
    assert (margins > 1e-3).float().mean() > 0.98
    assert margins.median() > 0.05


def test_cli_make_tiny_model_writes_a_checkpoint_and_reports_its_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "m"
    assert cli.main(["make-tiny-model", str(target), "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert str(target) in printed
    assert f"{num_checkpoint_elements(target):,} parameters" in printed
    assert (target / "generation_config.json").is_file()
    assert AutoTokenizer.from_pretrained(target).chat_template is not None


def test_cli_rejects_an_unknown_preset(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["make-tiny-model", str(tmp_path / "m"), "--preset", "huge"])
    assert exc.value.code == 2


def test_default_model_path_builds_once_under_the_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = default_model_path()
    assert path == tmp_path / "cache" / DEFAULT_MODEL_NAME
    assert (path / "model.safetensors").is_file()
    first_mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model_path() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == first_mtime
    # Only the finished folder and the lock remain; no staging folders are left behind.
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        f".{DEFAULT_MODEL_NAME}.lock",
        DEFAULT_MODEL_NAME,
    ]


def test_default_model_path_refuses_a_foreign_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path))
    (tmp_path / DEFAULT_MODEL_NAME).mkdir()
    (tmp_path / DEFAULT_MODEL_NAME / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="not a splitserve tiny model"):
        default_model_path()


def test_cli_and_default_model_import_and_parse_without_torch() -> None:
    code = (
        "import sys; import cli.main, splitserve.default_model, splitserve.tokenizer_files; "
        "cli.main.build_parser(); sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_default_model_path_rebuilds_a_checkpoint_from_an_older_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path))
    path = default_model_path()
    recipe = path / "splitserve_tiny_model.json"
    recipe.write_text(json.dumps({"version": 0, "preset": "tiny", "seed": 0}))
    assert default_model_path() == path
    assert json.loads(recipe.read_text())["version"] != 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{DEFAULT_MODEL_NAME}.lock", DEFAULT_MODEL_NAME]


def test_cli_make_tiny_model_into_a_folder_it_cannot_create_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert cli.main(["make-tiny-model", str(blocker / "m")]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"splitserve make-tiny-model: cannot write a checkpoint to {blocker / 'm'}: Not a directory; "
        "choose a folder you can write"
    ]


def test_two_first_uses_of_the_default_model_at_once_leave_one_whole_checkpoint(tmp_path: Path) -> None:
    # Two deployments starting together on a fresh machine: each process asks for the model.
    code = "from splitserve.default_model import default_model_path; print(default_model_path())"
    env = {**os.environ, "SPLITSERVE_CACHE_DIR": str(tmp_path)}
    children = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    paths = {child.communicate(timeout=300)[0].strip() for child in children}
    assert [child.returncode for child in children] == [0, 0]
    assert paths == {str(tmp_path / DEFAULT_MODEL_NAME)}
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{DEFAULT_MODEL_NAME}.lock", DEFAULT_MODEL_NAME]
    assert KimiLinearForCausalLM.from_pretrained(tmp_path / DEFAULT_MODEL_NAME) is not None
