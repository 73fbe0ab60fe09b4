"""Kinds outside the package (compiler/plugins.py, compiler/registry.py): docs/adding-a-family.md's
worked example run from a temporary package. Its module registers a norm kind (RMSNorm from the
2-norm) through an entry point of the group `zoo.kinds` (a *.dist-info on sys.path) or through the
user conf dir's plugins.yaml; the conf files of the page select it. The model it builds matches
transformers' Llama and zoo's own rmsnorm on the same checkpoint, through from_pretrained, `zoo
verify`, the compiled graphs, `zoo patterns` and a `zoo serve` process. Then every refusal:
a contract broken, a built-in name taken, a module that does not import or registers nothing, a
bad plugins.yaml or entry point, each naming the plugin."""
from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

import zoo
from zoo.cli import main
from zoo.compiler import registry
from zoo.compiler.errors import PluginError
from tests.helpers import assert_logits_close, check_decode_equals_prefill, check_parity

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent
MODULE = "lab_norms"  # the page's module


def doc_files() -> dict[str, str]:
    """The files of the page's plugin example: blocks whose first line is `# plugin file: NAME`."""
    text = (ROOT / "docs" / "adding-a-family.md").read_text()
    return {m.group(1): m.group(2)
            for m in re.finditer(r"```(?:yaml|python)\n# plugin file: (\S+)\n(.*?)```", text, re.S)}


@pytest.fixture
def isolated(monkeypatch):
    """The registry as it was before the test: kinds a test's plugins registered, the modules they
    imported and what the registry read are taken back (a later test sees zoo's kinds only)."""
    registry.kinds("norm")  # zoo's own kinds in first: the snapshot holds them
    kinds = {slot: dict(r) for slot, r in registry._REGISTRY.items()}
    imported = dict(registry._Plugins.imported)
    before = set(sys.modules)
    yield monkeypatch
    for slot, r in registry._REGISTRY.items():
        r.clear()
        r.update(kinds[slot])
    registry._Plugins.imported = imported
    registry._Plugins.key = None  # read again under the restored sys.path and environment
    for name in set(sys.modules) - before:
        if name.split(".")[0] not in ("zoo", "torch", "transformers"):
            del sys.modules[name]


def write_site(root: Path, modules: dict[str, str], entry_points: dict[str, str] | None = None) -> Path:
    """A site directory: the modules' files and, with entry_points, an installed distribution's
    metadata declaring them in the group zoo.kinds (as pip writes it)."""
    root.mkdir(parents=True, exist_ok=True)
    for name, text in modules.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    if entry_points is not None:
        info = root / "lab_kinds-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lab-kinds\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(
            "[zoo.kinds]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
    return root


def write_conf(root: Path, plugins_yaml: bool) -> Path:
    """The page's conf files (plugins.yaml only for the plugins-list route)."""
    for name, text in doc_files().items():
        if name.endswith(".yaml") and (plugins_yaml or name != "plugins.yaml"):
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
    return root


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny random Llama (a tokenizer, norm weights randomized) saved twice: as `llama` (zoo's
    shipped map, rmsnorm) and as `lab_llama` (the page's map: the plugin's norm), same weights."""
    from tests.helpers import randomize_constant_vectors
    from tests.serve_fixtures import write_tiny_llama

    root = tmp_path_factory.mktemp("plugin_ckpt")
    llama = write_tiny_llama(root / "llama")
    ref = transformers.LlamaForCausalLM.from_pretrained(llama).eval()
    torch.manual_seed(1)
    randomize_constant_vectors(ref)
    ref.save_pretrained(llama)
    lab = root / "lab"
    shutil.copytree(llama, lab)
    config = json.loads((lab / "config.json").read_text())
    (lab / "config.json").write_text(json.dumps({**config, "model_type": "lab_llama"}))
    return llama, lab, ref


def test_page_shows_the_files():
    files = doc_files()
    assert set(files) == {"lab_norms.py", "plugins.yaml", "norm/norm2_rms.yaml", "lab_llama_8b.yaml",
                          "hf/lab_llama.yaml"}
    # the page's map is the shipped Llama map but for its model_type and base
    shipped = (ROOT / "conf" / "hf" / "llama.yaml").read_text()
    body = lambda t: [ln for ln in t.splitlines() if ln and not ln.startswith("#")
                      and not ln.startswith(("model_type:", "base:"))]
    assert body(files["hf/lab_llama.yaml"]) == body(shipped)


def test_entry_point_kind_matches_transformers_and_rmsnorm(tmp_path, isolated, checkpoints):
    """The entry-point route: the kind registers from the distribution's entry point, the page's
    preset picks it, and the lab_llama checkpoint computes what transformers' Llama and zoo's
    rmsnorm compute on the same weights (prefill, every decode step, decode == prefill)."""
    llama, lab, ref = checkpoints
    site = write_site(tmp_path / "site", {f"{MODULE}.py": doc_files()["lab_norms.py"]}, {"lab_norms": MODULE})
    isolated.syspath_prepend(str(site))
    isolated.setenv("ZOO_CONF_DIR", str(write_conf(tmp_path / "conf", plugins_yaml=False)))
    assert "norm2_rms" in registry.kinds("norm")
    cls = registry.lookup("norm", "norm2_rms", "norm")
    assert cls.__module__ == MODULE and registry._Plugins.imported[MODULE].startswith(
        "entry point lab_norms = lab_norms (group zoo.kinds, distribution lab-kinds 0.1)")
    m = zoo.from_pretrained(str(lab), compile=False, max_batch=2, max_seq=32)
    assert {type(mod).__name__ for mod in m.module.modules()} >= {"Norm2RMS"}
    assert m.spec.norm.kind == "norm2_rms"
    ids = torch.randint(0, 384, (2, 7))
    seq = check_parity(ref, m, ids, steps=4, rtol=1e-5)
    check_decode_equals_prefill(m, seq, prompt_len=5)
    builtin = zoo.from_pretrained(str(llama), compile=False, max_batch=2, max_seq=32)
    assert builtin.spec.norm.kind == "rmsnorm"
    assert_logits_close(m.prefill(seq), builtin.prefill(seq), 1e-6, "plugin vs rmsnorm")
    # the page's preset builds dry, at Llama 3 8B's size
    assert zoo.build("lab_llama_8b", dry=True).info.params == zoo.build("llama3_8b", dry=True).info.params


def test_plugins_list_route_verifies(tmp_path, isolated, capsys):
    """The plugins.yaml route (a module on sys.path, no distribution), through `zoo verify` with
    transformers given the lab's classes (Llama's, under lab_llama), as the lab's package would."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    lab = type("LabLlamaConfig", (transformers.LlamaConfig,), {"model_type": "lab_llama"})
    isolated.setitem(transformers.CONFIG_MAPPING._extra_content, "lab_llama", lab)
    isolated.setitem(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "lab_llama", "LlamaForCausalLM")
    isolated.syspath_prepend(str(write_site(tmp_path / "site", {f"{MODULE}.py": doc_files()["lab_norms.py"]})))
    isolated.setenv("ZOO_CONF_DIR", str(write_conf(tmp_path / "conf", plugins_yaml=True)))
    assert main(["verify", "lab_llama"]) == 0
    assert "ok: worst relative error" in capsys.readouterr().out
    assert registry._Plugins.imported[MODULE] == f"{tmp_path / 'conf' / 'plugins.yaml'}: plugins[0] 'lab_norms'"


def test_compiled_and_patterns(tmp_path, isolated, checkpoints, capsys):
    """The compiled graphs (dynamo regions) hold the plugin's norm to transformers too, and
    `zoo patterns` runs over the plugin's model as over the shipped one: the same maps."""
    llama, lab, ref = checkpoints
    isolated.syspath_prepend(str(write_site(tmp_path / "site", {f"{MODULE}.py": doc_files()["lab_norms.py"]})))
    isolated.setenv("ZOO_CONF_DIR", str(write_conf(tmp_path / "conf", plugins_yaml=True)))
    m = zoo.from_pretrained(str(lab), compile=True, max_batch=2, max_seq=32, overrides=["runtime.aot=false"])
    assert m.engine.runner == "compiled"
    check_parity(ref, m, torch.randint(0, 384, (2, 7)), steps=3, rtol=1e-5)
    out = {}
    for name, path in (("lab", lab), ("llama", llama)):
        assert main(["patterns", f"weights={path}", "output=json", "repeat=6"]) == 0
        out[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["lab"].pop("model"), out["llama"].pop("model")) == ("lab_llama", "llama")
    assert_same_numbers(out["lab"], out["llama"])  # the norm's own arithmetic: float32 rounding apart


def assert_same_numbers(a, b, where: str = "") -> None:
    """Two JSON values equal in structure and text, their floats within 1e-5."""
    assert type(a) is type(b) or {type(a), type(b)} <= {int, float}, where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_numbers(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_numbers(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6), where
    else:
        assert a == b, where


def test_serve_in_a_fresh_process(tmp_path, checkpoints, monkeypatch):
    """`zoo serve` in its own process finds the kind at start-up (the entry point on PYTHONPATH) and
    answers greedy completions with the text the shipped rmsnorm model gives."""
    httpx = pytest.importorskip("httpx")
    from tests.serve_fixtures import running_server

    llama, lab, _ = checkpoints
    site = write_site(tmp_path / "site", {f"{MODULE}.py": doc_files()["lab_norms.py"]}, {"lab_norms": MODULE})
    monkeypatch.setenv("PYTHONPATH", f"{site}:{ROOT}")
    monkeypatch.setenv("ZOO_CONF_DIR", str(write_conf(tmp_path / "conf", plugins_yaml=False)))
    body = {"model": "lab", "prompt": "def add(a, b):", "max_tokens": 6, "temperature": 0}
    with running_server([f"weights={lab}", "model_name=lab", "max_seq=64", "max_batch=2", "compile=false",
                         "log_level=warning"], tmp_path) as (base, _):
        answer = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()
        card = httpx.get(f"{base}/v1/models", timeout=30).json()
    builtin = zoo.from_pretrained(str(llama), compile=False, max_batch=2, max_seq=64)
    prompt = builtin.tokenizer.encode(body["prompt"])
    want = builtin.generate(torch.tensor([prompt]), max_new_tokens=6)[0, len(prompt):].tolist()
    assert [c["id"] for c in card["data"]] == ["lab"]
    assert answer["usage"]["completion_tokens"] == len(want)
    assert answer["choices"][0]["text"] == builtin.tokenizer.decode(want)


def test_aot_key_follows_the_plugin_source(tmp_path, isolated, checkpoints):
    """A CPU AOTInductor package is keyed by the plugin's source as by zoo's: an edited kind
    misses instead of running the old code; zoo's own layers read no outside source."""
    from zoo.compiler.engine.compiling import outside_source_digest

    _, lab, _ = checkpoints
    site = write_site(tmp_path / "site", {f"{MODULE}.py": doc_files()["lab_norms.py"]})
    isolated.syspath_prepend(str(site))
    isolated.setenv("ZOO_CONF_DIR", str(write_conf(tmp_path / "conf", plugins_yaml=True)))
    m = zoo.from_pretrained(str(lab), compile=False, max_batch=2, max_seq=32)
    block = m.module.layers[0]
    first = outside_source_digest(block)
    assert first
    (site / f"{MODULE}.py").write_text(doc_files()["lab_norms.py"] + "\n# edited\n")
    assert outside_source_digest(block) != first
    llama = zoo.build("llama3_8b_tiny", dry=True)
    assert outside_source_digest(llama.module.layers[0]) == ""


# ----------------------------------------------------------------------------- refusals

GOOD = doc_files()["lab_norms.py"]


def _bad(body: str, name: str = "bad_norm") -> str:
    """A module defining one norm kind `name` with the class body `body`."""
    return ("from dataclasses import dataclass\nimport torch\n"
            "from zoo.compiler.contracts import KindSpec, Norm\nfrom zoo.compiler.registry import register\n\n"
            f"@register('norm', '{name}')\nclass Bad(Norm):\n" + body)


SPEC = "    @dataclass\n    class Spec(KindSpec):\n        kind: str = '{name}'\n"
FORWARD = "    def forward(self, x):\n        return x\n"
INIT = "    def init_weights(self, generator=None):\n        pass\n"

REFUSED = {
    # module text -> the words the error must hold (besides the plugin's origin and module)
    "missing_method": (_bad(SPEC.format(name="bad_norm") + FORWARD),
                       ["norm kind 'bad_norm'", "does not implement ['init_weights']"]),
    "wrong_signature": (_bad(SPEC.format(name="bad_norm") + INIT + "    def forward(self):\n        return 0\n"),
                        ["norm kind 'bad_norm'", "defines forward(self)", "an instance.forward(x)"]),
    "not_the_contract": ("import torch\nfrom dataclasses import dataclass\nfrom zoo.compiler.contracts import KindSpec\n"
                         "from zoo.compiler.registry import register\n\n@register('norm', 'bad_norm')\n"
                         "class Bad(torch.nn.Module):\n" + SPEC.format(name="bad_norm") + FORWARD,
                         ["norm kind 'bad_norm'", "is not a subclass of zoo.compiler.contracts.Norm"]),
    "kind_field": (_bad(SPEC.format(name="other_name") + FORWARD + INIT),
                   ["its Spec's `kind` field has the default 'other_name'; expected 'bad_norm'"]),
    "no_spec": (_bad(FORWARD + INIT), ["has no dataclass `Spec`"]),
    "schema": (_bad(SPEC.format(name="bad_norm") + "        dtype: torch.dtype = torch.float32\n" + FORWARD + INIT),
               ["its Spec is no valid config schema"]),
    "clash": (_bad(SPEC.format(name="rmsnorm") + FORWARD + INIT, name="rmsnorm"),
              ["norm kind 'rmsnorm'", "has the name of a built-in norm kind (zoo.compiler.norm.norms.RMSNorm)",
               "may not replace a built-in one"]),
    "import_error": ("import no_such_module_anywhere\n",
                     ["importing module", "failed: ModuleNotFoundError", "no_such_module_anywhere"]),
    "syntax_error": ("def broken(:\n", ["importing module", "failed: SyntaxError"]),
    "registers_nothing": ("X = 1\n", ["registered no kind", "@zoo.compiler.registry.register(slot, kind)"]),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
@pytest.mark.parametrize("route", ["entry_point", "plugins_yaml"])
def test_a_bad_plugin_is_refused_naming_it(tmp_path, isolated, case, route):
    """Each refusal is a PluginError naming where the module was named, the module and what is
    wrong; the good module beside it registers nothing either way (nothing half-loaded), and the
    registry keeps refusing (no silent skip on the next lookup)."""
    text, words = REFUSED[case]
    mod = f"lab_bad_{case}"
    site = write_site(tmp_path / "site", {f"{mod}.py": text}, {"bad": mod} if route == "entry_point" else None)
    conf = tmp_path / "conf"
    conf.mkdir()
    if route == "plugins_yaml":
        (conf / "plugins.yaml").write_text(f"plugins: [{mod}]\n")
    isolated.syspath_prepend(str(site))
    isolated.setenv("ZOO_CONF_DIR", str(conf))
    origin = (f"entry point bad = {mod} (group zoo.kinds, distribution lab-kinds 0.1)" if route == "entry_point"
              else f"{conf / 'plugins.yaml'}: plugins[0] '{mod}'")
    for _ in range(2):
        with pytest.raises(PluginError) as e:
            registry.kinds("norm")
        msg = str(e.value)
        assert msg.startswith(origin) and repr(mod) in msg, msg
        for w in words:
            assert w in msg, (w, msg)
    assert "bad_norm" not in registry._REGISTRY["norm"] and registry._REGISTRY["norm"]["rmsnorm"].__module__ == \
        "zoo.compiler.norm.norms"
    # the CLI prints it as zoo's error (exit 2), no traceback
    assert main(["build", "conf=llama3_8b_tiny"]) == 2


def test_a_half_registered_module_is_taken_back(tmp_path, isolated):
    """A module whose first kind registers and whose second breaks the contract leaves neither."""
    text = GOOD + "\n\n" + _bad(SPEC.format(name="bad_norm") + FORWARD).split("\n\n", 1)[1]
    site = write_site(tmp_path / "site", {"lab_half.py": text}, {"half": "lab_half"})
    isolated.syspath_prepend(str(site))
    isolated.setenv("ZOO_CONF_DIR", str(tmp_path))
    with pytest.raises(PluginError, match=r"module 'lab_half': norm kind 'bad_norm' .* does not implement"):
        registry.kinds("norm")
    assert "norm2_rms" not in registry._REGISTRY["norm"]


@pytest.mark.parametrize("text, words", [
    ("plugins: lab_norms\n", "plugins = 'lab_norms': expected a list of module names"),
    ("plugin: [lab_norms]\n", "expected a mapping with the one key `plugins`"),
    ("plugins: [lab-norms]\n", "plugins[0]: 'lab-norms' is not a module name"),
    ("plugins: [lab_norms\n", "not valid YAML"),
])
def test_a_bad_plugins_yaml_is_refused(tmp_path, isolated, text, words):
    (tmp_path / "plugins.yaml").write_text(text)
    isolated.setenv("ZOO_CONF_DIR", str(tmp_path))
    with pytest.raises(PluginError) as e:
        registry.kinds("norm")
    assert str(e.value).startswith(str(tmp_path / "plugins.yaml")) and words in str(e.value), str(e.value)


def test_an_entry_point_naming_an_object_is_refused(tmp_path, isolated):
    site = write_site(tmp_path / "site", {f"{MODULE}.py": GOOD}, {"lab_norms": f"{MODULE}:Norm2RMS"})
    isolated.syspath_prepend(str(site))
    isolated.setenv("ZOO_CONF_DIR", str(tmp_path))
    with pytest.raises(PluginError, match=r"entry point lab_norms = lab_norms:Norm2RMS \(group zoo.kinds, "
                                          r"distribution lab-kinds 0.1\): the value names 'Norm2RMS' inside "
                                          r"'lab_norms'; expected a module name"):
        registry.kinds("norm")


def test_plugins_yaml_is_no_preset(tmp_path, isolated, checkpoints, capsys):
    """plugins.yaml is not listed as a preset, and `zoo import name=plugins` may not overwrite it."""
    from zoo.compiler.config import available_configs

    (tmp_path / "plugins.yaml").write_text("plugins: []\n")
    isolated.setenv("ZOO_CONF_DIR", str(tmp_path))
    assert "plugins" not in available_configs() and "rmsnorm" in registry.kinds("norm")
    assert main(["import", str(checkpoints[0]), "name=plugins"]) == 2
    assert "is the user conf dir's plugins list" in capsys.readouterr().err
    assert (tmp_path / "plugins.yaml").read_text() == "plugins: []\n"


def test_two_plugins_may_not_share_a_kind(tmp_path, isolated):
    site = write_site(tmp_path / "site", {f"{MODULE}.py": GOOD, "lab_copy.py": GOOD},
                      {"a_first": MODULE, "b_second": "lab_copy"})
    isolated.syspath_prepend(str(site))
    isolated.setenv("ZOO_CONF_DIR", str(tmp_path))
    with pytest.raises(PluginError, match=r"entry point b_second = lab_copy .*: module 'lab_copy': norm kind "
                                          r"'norm2_rms' registered twice \(lab_norms and lab_copy\)"):
        registry.kinds("norm")


def test_a_weightless_qk_norm_needs_an_affine_field(tmp_path, isolated):
    """qk_norm_affine=false builds the model's norm kind without weight; the page's kind has no
    `affine` field, so that is refused by name, not built with a weight nobody loads."""
    from zoo.compiler.errors import ConfigError

    isolated.syspath_prepend(str(write_site(tmp_path / "site", {f"{MODULE}.py": GOOD})))
    isolated.setenv("ZOO_CONF_DIR", str(write_conf(tmp_path / "conf", plugins_yaml=True)))
    with pytest.raises(ConfigError, match=r"kind 'norm2_rms' has no `affine` field, so it has no form without weight"):
        zoo.build("lab_llama_8b", ["mixers.attn.qk_norm=true", "mixers.attn.qk_norm_affine=false"], dry=True)
    assert zoo.build("lab_llama_8b", ["mixers.attn.qk_norm=true"], dry=True).info.params > 0
