"""Bad input gets a clear error naming what is wrong, and leaves nothing half-built."""
from __future__ import annotations

import json
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import zoo
from zoo.compiler.config import load_config
from tests.test_llama import make_reference


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    make_reference(path, dict(num_attention_heads=4, num_key_value_heads=2), {})
    return path


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded")
    make_reference(path, dict(num_attention_heads=4, num_key_value_heads=2), {"max_shard_size": "100KB"})
    return path


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


# ----------------------------------------------------------------------------- configs

def test_unknown_conf_lists_available():
    with pytest.raises(zoo.ConfigError, match="unknown conf 'llama9'.*available: .*llama3_8b"):
        load_config("llama9")


def test_unknown_key_named():
    with pytest.raises(zoo.ConfigError, match="mixers.attn.n_kv_head"):
        load_config("llama3_8b_tiny", ["mixers.attn.n_kv_head=2"])
    with pytest.raises(zoo.ConfigError, match=r"mixers\.attn\.bogus.*valid keys"):
        load_config("llama3_8b_tiny", ["+mixers.attn.bogus=1"])
    with pytest.raises(zoo.ConfigError, match="colour"):
        load_config("llama3_8b_tiny", ["+colour=blue"])


def test_wrong_type_named():
    with pytest.raises(zoo.ConfigError, match="dim.*'abc'"):
        load_config("llama3_8b_tiny", ["dim=abc"])
    with pytest.raises(zoo.ConfigError, match="runtime.dtype.*float64"):
        load_config("llama3_8b_tiny", ["runtime.dtype=float64"])


def test_bad_override_syntax():
    with pytest.raises(zoo.ConfigError, match="dim"):
        load_config("llama3_8b_tiny", ["dim"])
    with pytest.raises(zoo.ConfigError, match="rope/nope"):
        load_config("llama3_8b_tiny", ["rope=nope"])


def test_unknown_kind_lists_kinds():
    with pytest.raises(zoo.ConfigError, match="mixers.attn.kind.*unknown mixer kind 'gqb'.*gqa"):
        load_config("llama3_8b_tiny", ["mixers.attn.kind=gqb"])


def test_inconsistent_dims_name_both_values():
    with pytest.raises(zoo.ConfigError, match="n_heads=5 does not divide dim=64"):
        load_config("llama3_8b_tiny", ["mixers.attn.n_heads=5"])
    with pytest.raises(zoo.ConfigError, match="n_kv_heads=3 does not divide n_heads=4"):
        load_config("llama3_8b_tiny", ["mixers.attn.n_kv_heads=3"])
    with pytest.raises(zoo.ConfigError, match="layout.*uses ffn 'moe'"):
        load_config("llama3_8b_tiny", ["layout=[{mixer: attn, ffn: moe}]"])
    with pytest.raises(zoo.ConfigError, match="runs add up to 3 layers but n_layers=2"):
        load_config("llama3_8b_tiny", ["layout=[{repeat: 3, mixer: attn, ffn: mlp}]"])


def test_config_json_errors(ckpt, tmp_path):
    bad = copy_ckpt(ckpt, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "jetmoe"}))  # unshipped: names what zoo lacks
    with pytest.raises(zoo.ConfigError, match=r"model_type 'jetmoe' is not supported \(zoo lacks: mixture of attention "
                                              r"heads.*conf/hf/_lacks.yaml\); supported: .*llama"):
        zoo.from_pretrained(str(bad), compile=False)
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    with pytest.raises(zoo.ConfigError, match="hidden_act='gelu'"):
        zoo.from_pretrained(str(bad), compile=False)
    del cfg["hidden_size"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(zoo.ConfigError, match="lacks required key 'hidden_size'"):
        zoo.from_pretrained(str(bad), compile=False)


# ----------------------------------------------------------------------------- checkpoints

def test_missing_shard(sharded, tmp_path):
    bad = copy_ckpt(sharded, tmp_path / "bad")
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (bad / victim).unlink()
    with pytest.raises(zoo.CheckpointError, match=f"missing: \\['{victim}'\\]"):
        zoo.from_pretrained(str(bad), compile=False)


@pytest.mark.parametrize("damage", ["truncate_data", "truncate_header", "garbage_header"])
def test_truncated_or_corrupt_safetensors(ckpt, tmp_path, damage):
    bad = copy_ckpt(ckpt, tmp_path / "bad")
    f = bad / "model.safetensors"
    data = f.read_bytes()
    if damage == "truncate_data":
        f.write_bytes(data[: len(data) - 1000])
        match = "truncated or corrupt"
    elif damage == "truncate_header":
        f.write_bytes(data[:5])
        match = "truncated safetensors file"
    else:
        f.write_bytes(data[:8] + b"{not json" + data[17:])
        match = "corrupt safetensors header"
    with pytest.raises(zoo.CheckpointError, match=match) as e:
        zoo.from_pretrained(str(bad), compile=False)
    assert "model.safetensors" in str(e.value)


def _rewrite(path, fn):
    f = path / "model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def test_wrong_tensor_shape(ckpt, tmp_path):
    bad = copy_ckpt(ckpt, tmp_path / "bad")
    _rewrite(bad, lambda t: t.__setitem__("model.layers.1.mlp.down_proj.weight", torch.zeros(64, 150)))
    with pytest.raises(zoo.CheckpointError,
                       match=r"model.layers.1.mlp.down_proj.weight: shape \[64, 150\] does not fit parameter "
                             r"layers.1.ffn.w2.weight \(expected \[64, 160\]"):
        zoo.from_pretrained(str(bad), compile=False)


def test_unmapped_tensor(ckpt, tmp_path):
    bad = copy_ckpt(ckpt, tmp_path / "bad")
    _rewrite(bad, lambda t: t.__setitem__("model.layers.0.self_attn.mystery.weight", torch.zeros(3)))
    with pytest.raises(zoo.CheckpointError, match="(?s)match no rule.*model.layers.0.self_attn.mystery.weight \\[3\\] F32"):
        zoo.from_pretrained(str(bad), compile=False)


def test_unfilled_parameter(ckpt, tmp_path):
    bad = copy_ckpt(ckpt, tmp_path / "bad")
    _rewrite(bad, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(zoo.CheckpointError, match=r"parameter norm.weight \[64\] is not filled"):
        zoo.from_pretrained(str(bad), compile=False)


def test_missing_companion_tensor(ckpt, tmp_path):
    bad = copy_ckpt(ckpt, tmp_path / "bad")
    _rewrite(bad, lambda t: t.pop("model.layers.2.self_attn.v_proj.weight"))
    with pytest.raises(zoo.CheckpointError, match="model.layers.2.self_attn.v_proj.weight"):
        zoo.from_pretrained(str(bad), compile=False)


def test_pickle_checkpoint_never_loaded(tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()

    class Boom:
        def __reduce__(self):
            return (exec, ("open(r'%s', 'w').write('ran')" % (tmp_path / "pwned"),))

    (d / "pytorch_model.bin").write_bytes(pickle.dumps({"w": Boom()}))
    (d / "config.json").write_text("{}")
    with pytest.raises(zoo.CheckpointError, match="never loads pickles"):
        zoo.from_pretrained(str(d), compile=False)
    with pytest.raises(zoo.CheckpointError, match="never loads pickles"):
        zoo.from_pretrained(str(d / "pytorch_model.bin"), compile=False)
    assert not (tmp_path / "pwned").exists()


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(zoo.CheckpointError, match="no such file or directory"):
        zoo.from_pretrained(str(tmp_path / "nothing-here" / "x"), compile=False)


# ----------------------------------------------------------------------------- runtime input

@pytest.fixture(scope="module")
def model(ckpt):
    return zoo.from_pretrained(str(ckpt), compile=False, max_batch=2, max_seq=16)


def test_prompt_longer_than_cache(model):
    with pytest.raises(zoo.InputError, match="prompt of 17 tokens must be in 1..max_seq=16"):
        model.prefill(torch.zeros(1, 17, dtype=torch.long))


def test_batch_over_max_batch(model):
    with pytest.raises(zoo.InputError, match="batch 3 must be in 1..max_batch=2"):
        model.prefill(torch.zeros(3, 4, dtype=torch.long))


def test_token_id_out_of_vocab(model):
    with pytest.raises(zoo.InputError, match="token id 320 is outside the vocabulary \\[0, 320\\)"):
        model.prefill(torch.tensor([[1, 2, 320]]))
    with pytest.raises(zoo.InputError, match="token id -1"):
        model.prefill(torch.tensor([[1, -1]]))


def test_decode_errors_leave_state_intact(model):
    seq = torch.randint(0, 320, (2, 10))
    full = model.prefill(seq)
    model.prefill(seq[:, :6])
    with pytest.raises(zoo.InputError, match=r"expected tokens of shape \[2\]"):
        model.decode(seq[0, 6:7])
    with pytest.raises(zoo.InputError, match="outside the vocabulary"):
        model.decode(torch.tensor([1, 999]))
    for t in range(6, 10):  # the failed calls changed nothing
        torch.testing.assert_close(model.decode(seq[:, t]), full[:, t], rtol=1e-5, atol=1e-5)


def test_decode_past_cache_end(model):
    model.prefill(torch.zeros(1, 15, dtype=torch.long))
    model.decode(torch.tensor([1]))
    with pytest.raises(zoo.InputError, match="cache is full \\(max_seq=16"):
        model.decode(torch.tensor([1]))


def test_decode_before_prefill(model):
    model.reset()
    with pytest.raises(zoo.InputError, match="call prefill first"):
        model.decode(torch.tensor([1]))


def test_too_big_for_device_fails_before_allocating():
    with pytest.raises(zoo.ZooError, match="needs .* GiB .* available; nothing was allocated"):
        zoo.build("llama3_8b", ["runtime.max_seq=64"], dry=False, compile=False)


def test_the_zoo_command_flushes_before_its_fast_exit():
    """`python -m zoo` (what the `zoo` script runs) ends with os._exit, skipping Python's ~1 s
    shutdown after torch: everything printed reaches the pipe, and the exit status is main's
    (2 for an error, with its message on stderr)."""
    import subprocess
    import sys

    from zoo.compiler.config import available_configs

    ok = subprocess.run([sys.executable, "-m", "zoo", "configs"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert all(name in ok.stdout for name in available_configs())
    bad = subprocess.run([sys.executable, "-m", "zoo", "generate", "conf=no_such_conf", "prompt=hi"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "unknown conf 'no_such_conf'" in bad.stderr


@pytest.mark.parametrize("argv, words", [
    # a key another command reads: named with its value, the command, and what the command takes
    (["build", "conf=llama3_8b_tiny", "temperature=0.7"],
     ["zoo build does not use temperature='0.7'", "zoo generate", "conf=", "dry=", "Hydra overrides"]),
    (["generate", "conf=llama3_8b_tiny", "prompt=hi", "dry=true"], ["zoo generate does not use dry='true'",
                                                                    "max_new_tokens=", "temperature="]),
    (["report", "conf=llama3_8b", "host=0.0.0.0"], ["zoo report does not use host=", "zoo serve", "context="]),
    (["serve", "conf=llama3_8b_tiny", "output=json"], ["zoo serve does not use output=", "port=", "api_key="]),
    (["check", "weights=x", "prompt=hi"], ["zoo check does not use prompt=", "conf=, revision=, weights="]),
    # a serve value that is not what the key takes: named before the model loads
    (["serve", "conf=llama3_8b_tiny", "prefix_cache_mib=1G"], ["prefix_cache_mib='1G'", "whole number of MiB",
                                                               "0 turns prefix reuse off"]),
    (["families", "markdown=true", "conf=llama3_8b"], ["zoo families does not use conf=", "markdown="]),
    # commands that read no config refuse what they would ignore
    (["configs", "dim=8"], ["zoo configs reads no config", "'dim=8'", "no key=value options"]),
    (["cache", "clear", "seed=1"], ["zoo cache does not use seed='1'", "no key=value options"]),
    (["diff", "llama3_8b", "llama3_8b_tiny", "residual=mhc"], ["overrides inside a target", "'residual=mhc'"]),
])
def test_cli_refuses_a_key_the_command_does_not_use(argv, words, capsys):
    """In process (no subprocess): the refusal comes before anything is composed or loaded."""
    from zoo.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_cli_passes_config_keys_to_compose(monkeypatch):
    """What is not a zoo key of any command is a Hydra override, as before; so is a key another
    command reads when it is also a config field (import's name= is the config's name on build)."""
    from zoo import cli

    seen = {}
    monkeypatch.setattr(cli, "cmd_build", lambda opts, overrides: seen.update(opts=opts, overrides=overrides) or 0)
    assert cli.main(["build", "conf=llama3_8b_tiny", "dim=8", "+extra.key=1", "~mtp", "mixers.attn.n_kv_heads=1",
                     "name=mine", "max_seq=64", "tp=2", "dry=true"]) == 0
    assert seen["opts"] == {"conf": "llama3_8b_tiny", "dry": "true"}
    assert seen["overrides"] == ["dim=8", "+extra.key=1", "~mtp", "mixers.attn.n_kv_heads=1", "name=mine",
                                 "runtime.max_seq=64", "runtime.parallel.tp=2"]


def test_cli_override_of_no_config_key_is_a_compose_error(capsys):
    """An override that is neither a zoo key nor a config key reaches compose, which names it."""
    from zoo.cli import main

    assert main(["build", "conf=llama3_8b_tiny", "no_such_key=1", "dry=true"]) == 2
    err = capsys.readouterr().err
    assert "no_such_key" in err and "llama3_8b_tiny" in err, err
