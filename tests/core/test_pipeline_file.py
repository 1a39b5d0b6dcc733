"""Pipeline file loading: every error at its file:line:col, all at once, before anything runs.

The broken files in ``broken/`` state their expected errors in ``# expect: LINE:COL: message``
header lines; each is checked as a substring of the ``file:line:col: message`` line, and the
number of errors must match the number of expectations.
"""

from __future__ import annotations

import os
import re
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import pytest

from dflash_core import Stage, hookimpl
from dflash_core import devices
from dflash_core.errors import PipelineFileError
from dflash_core.pipeline_file import load_pipeline, load_pipeline_text
from dflash_core.plugins import PluginManager
from tests.conftest import REPO

BROKEN = Path(__file__).parent / "broken"


# -- test stages ---------------------------------------------------------------------------

@dataclass
class FetchConfig:
    source: str
    pattern: str = "*.jsonl"


class Fetch(Stage):
    kind, name, Config, inputs = "download", "fsspec", FetchConfig, ()
    default_link = "materialize"


@dataclass
class SaveConfig:
    dest: str
    every_steps: int = 1000


class Save(Stage):
    kind, name, Config = "checkpoint", "fsspec", SaveConfig


@dataclass
class TokConfig:
    tokenizer: str
    thinking: bool = False
    max_len: int = 4096
    mode: Literal["fast", "slow"] = "fast"
    stop: list[str] = field(default_factory=list)
    min_loss_tokens: Optional[int] = None


class ChatTemplate(Stage):
    kind, name, Config, inputs = "tokenize", "chat_template", TokConfig, ("records",)
    default_link = "materialize"


@dataclass
class PackConfig:
    tokens_per_row: int = 16384


class BestFit(Stage):
    kind, name, Config = "pack", "best_fit", PackConfig


class Naive(Stage):
    kind, name, Config = "pack", "naive", PackConfig


@dataclass
class Opt:
    name: str = "adamw"
    weight_decay: float = 0.0


@dataclass
class TrainConfig:
    lr: float = 6e-4
    block_size: int = 16
    layers: str | list[int] = "auto"
    betas: tuple[float, ...] = (0.9, 0.95)
    extra: dict[str, int] = field(default_factory=dict)
    opt: Opt = field(default_factory=Opt)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")


class Dflash(Stage):
    kind, name, Config = "train", "dflash", TrainConfig
    default_executor = "process"


class Zip(Stage):
    kind, name, inputs = "merge", "zip", ("left", "right")


class Evaluate(Stage):
    kind, name, inputs = "evaluate", "acceptance", ("drafter", "tokenize")


STAGES = (Fetch, Save, ChatTemplate, BestFit, Naive, Dflash, Zip, Evaluate)


def make_plugins(extra_plugins: tuple[str, ...] = ()) -> PluginManager:
    plugin = types.SimpleNamespace(__name__="tests.core.test_stages")

    @hookimpl
    def dflash_pipe_register_stages(registry):
        for cls in STAGES:
            registry.add(cls)

    plugin.dflash_pipe_register_stages = dflash_pipe_register_stages
    pm = PluginManager(disabled=["builtin"], autoload=False, extra_plugins=extra_plugins)
    pm.add_plugin(plugin, "test_stages")
    return pm


@pytest.fixture(autouse=True)
def two_gpus(monkeypatch):
    """Deterministic device checks: two CUDA devices visible, whatever this machine has."""
    monkeypatch.setattr(devices, "visible_cuda_devices", lambda: 2)


@pytest.fixture(scope="module")
def plugins() -> PluginManager:
    return make_plugins()


def errors_of(path, plugins, overrides=()) -> PipelineFileError:
    with pytest.raises(PipelineFileError) as info:
        load_pipeline(path, plugins, overrides)
    return info.value


def expectations(path: Path) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^# expect: (.+)$", path.read_text(), re.M)]


BROKEN_FILES = sorted(BROKEN.glob("*.yaml"))


def test_enough_broken_files():
    assert len(BROKEN_FILES) >= 12
    for path in BROKEN_FILES:
        assert expectations(path), f"{path.name} has no '# expect:' header"


@pytest.mark.parametrize("path", BROKEN_FILES, ids=lambda p: p.stem)
def test_broken_file(path, plugins):
    err = errors_of(str(path), plugins)
    lines = [str(e) for e in err.errors]
    expected = expectations(path)
    for exp in expected:
        want = f"{path}:{exp}"
        assert any(want in line for line in lines), f"missing {want!r} in:\n" + "\n".join(lines)
    assert len(lines) == len(expected), "\n".join(lines)


def test_many_problems_reported_at_once(plugins):
    err = errors_of(str(BROKEN / "many_problems.yaml"), plugins)
    assert len(err.errors) >= 8
    assert len({e.line for e in err.errors}) >= 8
    assert err.exit_code == 2


def test_format_shows_line_and_caret(plugins):
    path = BROKEN / "unknown_param.yaml"
    text = errors_of(str(path), plugins).format()
    assert f"{path}:8:40: unknown param 'max_lne' for tokenize:chat_template " \
           f"(did you mean 'max_len'?)\n" \
           "      tokenize: {after: download, params: {max_lne: 8192, tokenizer: qwen}}\n" \
           "    " + " " * 39 + "^\n" in text
    assert text.rstrip().endswith("\n3 errors")


def test_unknown_impl_names_failed_plugin():
    pm = make_plugins(extra_plugins=("no_such_module_for_dflash_tests",))
    text = "version: 1\nstages:\n  fetch: {uses: s3_fetch, params: {}}\n"
    with pytest.raises(PipelineFileError) as info:
        load_pipeline_text(text, pm, path="p.yaml")
    (err,) = info.value.errors
    assert err.location == "p.yaml:3:17"
    assert "unknown stage implementation 's3_fetch'" in err.message
    assert ("plugin 'no_such_module_for_dflash_tests' (no_such_module_for_dflash_tests) failed "
            "to import: ModuleNotFoundError: No module named 'no_such_module_for_dflash_tests'"
            ) in err.message


def test_missing_file(plugins, tmp_path):
    err = errors_of(str(tmp_path / "nope.yaml"), plugins)
    assert str(err.errors[0]).startswith(f"{tmp_path / 'nope.yaml'}:1:1: cannot read pipeline file")


# -- a valid file --------------------------------------------------------------------------

VALID = """\
version: 1
defaults: {executor: thread}
stages:
  download: {uses: fsspec, params: {source: "s3://bucket/*.jsonl"}}
  tokenize:
    uses: chat_template
    after: download
    params: {tokenizer: qwen, thinking: true, max_len: 8192, mode: slow, stop: ["</s>"]}
  pack: {uses: pack:naive, after: tokenize, link: stream, executor: inline}
  train:
    uses: dflash
    after: [pack]
    device: cuda:1
    params:
      lr: 3e-4
      layers: [1, 2, 3]
      betas: [0.8, 1]
      extra: {a: 1}
      opt: {weight_decay: 0.1}
  checkpoint: {uses: checkpoint:fsspec, after: train, executor: process, params: {dest: /tmp/ck}}
  both: {uses: zip, after: {right: pack, left: tokenize}}
  evaluate: {after: [tokenize, train]}
"""


def write(tmp_path, text, name="valid.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_valid_round_trip(plugins, tmp_path):
    path = write(tmp_path, VALID)
    p = load_pipeline(path, plugins)
    assert p.path == path and p.version == 1 and p.run_dir == str(tmp_path / "runs" / "valid")
    assert list(p.stages) == ["download", "tokenize", "pack", "train", "checkpoint", "both",
                              "evaluate"]
    s = p.stages
    assert s["download"].cls is Fetch and s["download"].after == {}
    assert s["download"].config == FetchConfig(source="s3://bucket/*.jsonl")
    assert s["tokenize"].after == {"records": "download"}
    assert s["tokenize"].config == TokConfig("qwen", True, 8192, "slow", ["</s>"], None)
    assert s["pack"].cls is Naive and s["pack"].link == "stream" and s["pack"].executor == "inline"
    assert s["pack"].config == PackConfig()
    train = s["train"]
    assert train.cls is Dflash and train.device == "cuda:1" and train.executor == "thread"
    assert train.after == {"items": "pack"}
    assert train.config == TrainConfig(lr=3e-4, layers=[1, 2, 3], betas=(0.8, 1.0),
                                       extra={"a": 1}, opt=Opt(weight_decay=0.1))
    assert isinstance(train.config.lr, float) and isinstance(train.config.betas[1], float)
    assert train.params == {"lr": 3e-4, "layers": [1, 2, 3], "betas": [0.8, 1.0],
                            "extra": {"a": 1}, "opt": {"name": "adamw", "weight_decay": 0.1}}
    assert s["checkpoint"].cls is Save and s["checkpoint"].executor == "process"
    assert s["both"].after == {"left": "tokenize", "right": "pack"}
    assert s["evaluate"].cls is Evaluate and s["evaluate"].uses == "evaluate"
    assert s["evaluate"].after == {"tokenize": "tokenize", "drafter": "train"}
    assert s["download"].device == "cpu" and s["download"].link is None
    assert s["train"].mark.line == 10 and s["train"].mark.col == 3
    # the graph the runner sees
    assert p.link("download", "tokenize") == "materialize"
    assert p.link("tokenize", "pack") == "stream"
    assert p.order().index("train") < p.order().index("checkpoint")


def test_defaults_and_class_defaults(plugins, tmp_path):
    text = ("version: 1\nrun_dir: /tmp/r\ndefaults: {device: cuda}\nstages:\n"
            "  download: {params: {source: s}}\n  train: {after: download, params: {block_size: 4}}\n")
    p = load_pipeline(write(tmp_path, text, "x.yaml"), plugins)
    assert p.run_dir == "/tmp/r"
    fetch, spec = p.stages.values()
    assert fetch.device == "cuda:0" and fetch.executor == "thread" and fetch.after == {}
    assert spec.device == "cuda:0" and spec.executor == "process"
    assert spec.uses == "train" and spec.config.block_size == 4


# -- --set ---------------------------------------------------------------------------------

def test_set_overrides_apply(plugins, tmp_path):
    path = write(tmp_path, VALID)
    p = load_pipeline(path, plugins, [
        "stages.train.params.lr=3e-5", "run_dir=/tmp/x", "stages.pack.device=cuda:0",
        "stages.tokenize.params.thinking=false", "stages.train.params.layers=[4,5]",
        "stages.pack.params.tokens_per_row=99", "defaults.executor=inline",
        "stages.train.params.opt.name=sgd"])
    assert p.run_dir == "/tmp/x"
    assert p.stages["train"].config.lr == 3e-5 and p.stages["train"].config.layers == [4, 5]
    assert p.stages["train"].config.opt == Opt("sgd", 0.1)
    assert p.stages["pack"].device == "cuda:0" and p.stages["pack"].config.tokens_per_row == 99
    assert p.stages["tokenize"].config.thinking is False
    assert p.stages["train"].executor == "inline" and p.stages["pack"].executor == "inline"


def test_set_errors(plugins, tmp_path):
    path = write(tmp_path, VALID)
    overrides = [
        "stagse.train.params.lr=1",                # 1 unknown top-level key
        "stages.trian.params.lr=1",                # 2 unknown stage
        "run_dir.sub=1",                           # 3 through a non-mapping
        "stages.train.params.lr=abc",              # 4 bad type
        "stages.train.params.lrr=0.1",             # 5 created, then unknown param
        "stages.train.link=steam",                 # 6 bad link
        "no_equals_sign",                          # 7 not PATH=VALUE
        "stages.train.params.layers=[1, 2",        # 8 YAML error in the value
        "stages.train.params.opt.weight_decay=x",  # 9 nested bad type
        "stages.train.devcie=cpu",                 # 10 unknown stage key
    ]
    err = errors_of(path, plugins, overrides)
    got = [str(e) for e in err.errors]
    expected = [
        "--set:1:1: --set: unknown top-level key 'stagse' (did you mean 'stages'?)",
        "--set:2:8: --set: no stage 'trian' (did you mean 'train'?)",
        "--set:3:9: --set path goes through 'run_dir', which is not a mapping",
        "--set:4:24: param 'lr' must be float, got str 'abc'",
        "--set:5:21: unknown param 'lrr' for train:dflash (did you mean 'lr'?)",
        "--set:6:19: 'link' must be one of stream, materialize, got 'steam' "
        "(did you mean 'stream'?)",
        "--set:7:1: --set needs PATH=VALUE, got 'no_equals_sign'",
        "--set:8:",
        "--set:9:38: param 'opt.weight_decay' must be float, got str 'x'",
        "--set:10:14: unknown key 'devcie' in stage 'train' (did you mean 'device'?)",
    ]
    assert len(got) == len(expected), "\n".join(got)
    for want in expected:
        assert any(line.startswith(want) for line in got), f"{want!r} not in\n" + "\n".join(got)
    formatted = err.format()
    assert "    stages.train.params.lr=abc\n" + " " * 27 + "^" in formatted


def test_set_value_error_does_not_point_at_file(plugins, tmp_path):
    path = write(tmp_path, VALID)
    err = errors_of(path, plugins, ["stages.train.device=tpu"])
    assert [str(e) for e in err.errors] == [
        "--set:1:21: unknown device 'tpu' (expected cpu, cuda, cuda:N or mps)"]



def test_anchors_merge_keys_and_extension_keys(plugins, tmp_path):
    text = ("version: 1\nx-gpu: &gpu {device: cuda:1, executor: inline}\nstages:\n"
            "  download: {params: {source: s}}\n"
            "  pack: {<<: *gpu, uses: naive, after: download}\n"
            "  train: {<<: *gpu, after: pack, executor: process}\n")  # explicit key wins
    p = load_pipeline(write(tmp_path, text), plugins)
    assert p.stages["pack"].device == "cuda:1" and p.stages["pack"].executor == "inline"
    assert p.stages["train"].device == "cuda:1" and p.stages["train"].executor == "process"


def test_unsafe_tags_and_source_link(plugins):
    text = ("version: 1\nstages:\n"
            "  download: {link: stream, params: {source: !!python/object:os.system x}}\n")
    with pytest.raises(PipelineFileError) as info:
        load_pipeline_text(text, plugins, path="t.yaml")
    got = [str(e) for e in info.value.errors]
    assert got == [
        "t.yaml:3:14: 'link' sets how a stage's inputs arrive, and 'download' (download:fsspec) "
        "is a source stage; set it on the consumers",
        "t.yaml:3:45: invalid YAML value: could not determine a constructor for the tag "
        "'tag:yaml.org,2002:python/object:os.system'"]


def test_set_duplicate_upstream_and_through_list(plugins, tmp_path):
    path = write(tmp_path, VALID)
    err = errors_of(path, plugins, ["stages.pack.after=[tokenize, tokenize]",
                                    "stages.train.after.x=1"])
    assert [str(e) for e in err.errors] == [
        "--set:1:30: stage 'tokenize' is listed twice in 'after'",
        "--set:2:20: --set path goes through 'stages.train.after', which is a list, "
        "not a mapping"]


def test_relative_paths_resolve_against_the_pipeline_files_directory(tmp_path, monkeypatch):
    """The default pipeline loaded from the repo root and from elsewhere, by an absolute or a
    relative name, reads the same files and writes to the same run dir; nothing appears in the
    other directory."""
    builtin = PluginManager()
    path = REPO / "pipelines" / "online_train.yaml"
    seen = set()
    for cwd in (REPO, tmp_path):
        monkeypatch.chdir(cwd)
        for name in (str(path), os.path.relpath(path)):
            p = load_pipeline(name, builtin)
            seen.add((p.run_dir, p.stages["download"].config.source,
                      p.stages["train"].config.heldout, p.stages["checkpoint"].config.dest))
    data = REPO / "pipelines" / "data" / "default"
    assert seen == {(str(REPO / "runs" / "online_train"), str(data / "train-*.jsonl"),
                     str(data / "heldout.jsonl"), None)}
    assert list(tmp_path.iterdir()) == []


def test_set_paths_resolve_against_the_current_directory(tmp_path, monkeypatch):
    """A path typed with --set is relative to where it is typed; URLs, ~ and absolute paths
    stay as written, in a list too."""
    monkeypatch.chdir(tmp_path)
    p = load_pipeline(REPO / "pipelines" / "online_train.yaml", PluginManager(), [
        "run_dir=out/run", "stages.train.params.heldout=h.jsonl",
        "stages.checkpoint.params.dest=s3://bucket/drafter",
        "stages.download.params.source=[a/*.jsonl, 's3://b/*.jsonl', /abs/x.jsonl, ~/y.jsonl]"])
    assert p.run_dir == str(tmp_path / "out" / "run")
    assert p.stages["train"].config.heldout == str(tmp_path / "h.jsonl")
    assert p.stages["checkpoint"].config.dest == "s3://bucket/drafter"
    assert p.stages["download"].config.source == [str(tmp_path / "a" / "*.jsonl"), "s3://b/*.jsonl",
                                                  "/abs/x.jsonl", "~/y.jsonl"]
