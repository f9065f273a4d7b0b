"""A typo in an Engine keyword or a CLI flag, or another trainer's name for a setting, is
one line of error with the suggestion (a ConfigError for keywords, exit 2 for flags)."""

from __future__ import annotations

import pytest
import torch
from cli_helpers import run_cli
from common import make_model
from world_of_one import world_of_one  # noqa: F401 - fixture

import zerostate
from zerostate.errors import ConfigError

KEYWORDS = [
    ({"precison": "bf16"}, "did you mean precision=?"),
    ({"gradient_accumulation_steps": 4}, "did you mean grad_accum_steps=?"),
    ({"grad_acum_steps": 4}, "did you mean grad_accum_steps=?"),
    ({"stgae": 3}, "did you mean stage=?"),
    ({"max_grad_norm": 1.0}, "did you mean grad_clip=?"),
    ({"learning_rate": 1e-3}, "did you mean lr=?"),
    ({"bf16": True}, 'did you mean precision="bf16"?'),
    ({"steps_per_print": 10}, "did you mean log_every=?"),
    ({"weight_decy": 0.1}, "did you mean weight_decay=?"),
    ({"colective_timeout_s": 5}, "did you mean collective_timeout_s=?"),
]


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize(("settings", "needle"), KEYWORDS, ids=[next(iter(k)) for k, _ in KEYWORDS])
def test_engine_keyword_typo(settings: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        zerostate.Engine(make_model(), **settings)
    message = str(info.value)
    assert needle in message and "\n" not in message, message
    assert f"unknown setting {next(iter(settings))}=" in message


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize(
    "precision", [torch.bfloat16, "bfloat16", "torch.bfloat16", "BF16", "bf16"]
)
def test_precision_spellings(precision) -> None:
    engine = zerostate.Engine(make_model(), stage=1, precision=precision)
    assert engine.config.precision == "bf16" and engine.dtype == torch.bfloat16


FLAGS = [
    (["consolidate", "ckpt", "out", "--dtpye", "bf16"], "did you mean --dtype?"),
    (["consolidate", "ckpt", "out", "--max-shard-sise", "5GB"], "did you mean --max-shard-size?"),
    (["inspect", "ckpt", "--stpe", "3"], "did you mean --step?"),
    (["verify", "ckpt", "--storage-opton", "anon=true"], "did you mean --storage-option?"),
    (["reshard", "a", "b", "--world-size", "2", "--froce"], "did you mean --force?"),
    (["estimate", "--params", "1e9", "--dp", "8", "--stgae", "3"], "did you mean --stage"),
    # A typo in a required flag: argparse reports the missing flag before the unknown one.
    (["reshard", "a", "b", "--world-sise", "2"], "did you mean --world-size?"),
    (["reshard", "a", "b", "--world-sise=2", "--force"], "did you mean --world-size?"),
]


@pytest.mark.parametrize(
    ("argv", "needle"),
    FLAGS,
    ids=[f[1].split()[-1].rstrip("?") + f"-{i}" for i, f in enumerate(FLAGS)],
)
def test_cli_flag_typo(argv: list[str], needle: str, capsys) -> None:
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    assert err.startswith("zerostate: error: ") and err.count("\n") == 1, err
    assert needle in err, err


def test_missing_required_flag_without_a_typo_says_so(capsys) -> None:
    code, _, err = run_cli(["reshard", "a", "b", "--force"], capsys)
    assert code == 2 and "the following arguments are required: --world-size" in err, err


def test_cli_names_the_root_of_a_step_directory(tmp_path, capsys) -> None:
    code, _, err = run_cli(["inspect", str(tmp_path / "ckpt" / "step-00000016")], capsys)
    assert code == 1 and err.count("\n") == 1
    assert "one step's directory" in err and f"inspect {tmp_path / 'ckpt'} --step 16" in err


NESTED = [
    ({"client_kwargs": {"endpoint-url": "http://127.0.0.1:1"}}, "client_kwargs.endpoint-url"),
    ({"config_kwargs": {"read_timout": 5}}, "config_kwargs.read_timout"),
    ({"endpoint-url": "http://127.0.0.1:1"}, "endpoint-url"),
]
SUGGESTED = {"client_kwargs": "endpoint_url", "config_kwargs": "read_timeout"}


@pytest.mark.parametrize(("options", "key"), NESTED, ids=[k for _, k in NESTED])
def test_check_storage_catches_option_typos_before_connecting(options: dict, key: str) -> None:
    # Port 1 refuses connections: an error naming the key proves nothing connected.
    with pytest.raises(ConfigError) as info:
        zerostate.check_storage("s3://bucket/run", options)
    suggestion = SUGGESTED.get(key.split(".")[0], "endpoint_url")
    assert str(info.value).startswith(f"{key}:") and f"did you mean {suggestion}?" in str(
        info.value
    )


def test_cli_catches_a_nested_option_typo(capsys) -> None:
    option = "client_kwargs.endpoint-url=http://127.0.0.1:1"
    code, _, err = run_cli(["inspect", "s3://bucket/run", "--storage-option", option], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "client_kwargs.endpoint-url" in err and "did you mean endpoint_url?" in err


def test_check_storage_accepts_a_local_root(tmp_path) -> None:
    location = zerostate.check_storage(str(tmp_path / "run"))
    assert (tmp_path / "run").is_dir() and location.endswith("/run")
    with pytest.raises(ConfigError, match="local path"):
        zerostate.check_storage(str(tmp_path / "run"), {"anon": True})


@pytest.mark.parametrize("text", ["bf16", "bfloat16", "torch.bfloat16", "BFloat16"])
def test_consolidate_dtype_spellings(text: str) -> None:
    from zerostate_cli.main import build_parser

    args = build_parser().parse_args(["consolidate", "ckpt", "out", "--dtype", text])
    assert args.dtype == torch.bfloat16
