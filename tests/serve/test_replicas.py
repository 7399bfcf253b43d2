"""Replicas and autoscaling through Ray Serve's own options, and `pipeline.serve:build_app` as
Ray Serve's app builder (string arguments, as `serve run` passes them, and docs/serve-config.yaml
as `serve deploy` reads it).

Live: ONE app of two replicas of the tiny model, built from string arguments, on the
session's Serve (tests/serve/conftest.py's `two_replicas`, shared with the routing and metrics
tests): both replicas answer (each response names its replica) and greedy answers are Hugging
Face `generate`'s on each. Without Ray: the
deployment options the builder gives, and the command line's exit 2 naming the flag for a bad
combination. Timeouts are hang guards only."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from actors.allocator import find_tcmalloc, preload_env
from actors.config import EngineConfig
from pipeline.commands.console import TOKEN_AUTH_LOGGER
from pipeline.commands.serve import main as serve_main
from pipeline.serve import ServeConfig, build_app
from pipeline.serve.app import replica_options
from pipeline.serve.replicas import DRAIN_CHECK_S, REPLICA_HEADER
from tests.serve.conftest import MODEL, TWO_REPLICAS, serve_run_builder
from tests.serve.hf_reference import HFReference

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]


def deployment_of(app: Any) -> Any:
    """The engine deployment an Application binds, behind the prefix-routing front if there
    is one (Serve keeps it private: `_bound_deployment`)."""
    deployment = app._bound_deployment
    if deployment.name == "raypack-front":
        deployment = deployment.init_args[0]._bound_deployment
    return deployment


# --- the builder and its options, without Ray -------------------------------------------------


def test_builder_takes_string_args_as_serve_run_passes_them() -> None:
    app = serve_run_builder(
        {
            "model": "/models/m",
            "num_replicas": "2",
            "num-cpus": "0.5",
            "max_num_seqs": "8",
            "allocator": "system",
        }
    )
    deployment = deployment_of(app)
    assert deployment.num_replicas == 2
    assert deployment._deployment_config.autoscaling_config is None
    assert deployment.ray_actor_options == {"num_cpus": 0.5}
    (config,) = deployment.init_args
    assert isinstance(config, ServeConfig)
    assert config.engine.model == "/models/m"
    assert config.engine.max_num_seqs == 8
    assert config.num_cpus == 0.5


def test_builder_with_autoscaling_args_sets_serves_autoscaling_config() -> None:
    app = serve_run_builder(
        {"model": "m", "min_replicas": "2", "max_replicas": "5", "target_ongoing_requests": "6"}
    )
    autoscaling = deployment_of(app)._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas) == (2, 5)
    assert autoscaling.target_ongoing_requests == 6
    # without a target: what one engine runs at once
    app = build_app({"model": "m", "max_replicas": 3, "max_num_seqs": 12})
    autoscaling = deployment_of(app)._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas) == (1, 3)
    assert autoscaling.target_ongoing_requests == 12


def test_stopping_replicas_and_front_check_their_requests_often() -> None:
    """Serve's 2 s default drain check is a 2 s sleep before an idle replica stops (each
    `raypack serve` stop, scale-down and redeploy): both deployments check every
    DRAIN_CHECK_S instead."""
    front = build_app({"model": "m", "num_replicas": "2"})._bound_deployment
    assert front.name == "raypack-front"
    for deployment in (front, deployment_of(build_app({"model": "m"}))):
        assert deployment._deployment_config.graceful_shutdown_wait_loop_s == DRAIN_CHECK_S
        assert deployment._deployment_config.graceful_shutdown_timeout_s >= 20  # Serve's bound
    assert DRAIN_CHECK_S < 2.0


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({"num_replicas": "two"}, "--num-replicas"),
        ({"max_replicas": "2", "num_replicas": "2"}, "--max-replicas"),
        ({"min_replicas": "3", "max_replicas": "2"}, "--min-replicas"),
        ({"no_prefix_caching": "maybe"}, "no_prefix_caching"),
        ({"port": "8000"}, "port"),
        ({"replicas": "2"}, "replicas"),
    ],
)
def test_builder_refuses_bad_args_naming_them(args: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        build_app({"model": "m", **args})


def test_docs_config_is_a_serve_deploy_config_of_this_builder() -> None:
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(
        yaml.safe_load((ROOT / "docs" / "serve-config.yaml").read_text())
    )
    (app_config,) = config.applications
    assert app_config.import_path == "pipeline.serve:build_app"
    deployment = deployment_of(serve_run_builder(app_config.args))
    assert deployment.num_replicas == app_config.args["num_replicas"]


def test_one_gpu_per_replica_when_the_engine_runs_on_cuda() -> None:
    cpu = ServeConfig(
        engine=EngineConfig(dtype="float32", model="m", device="cpu"),
        num_cpus=0.5,
        allocator="system",
    )
    assert replica_options(cpu)["ray_actor_options"] == {"num_cpus": 0.5}
    cuda = replace(cpu, engine=replace(cpu.engine, device="cuda"))
    assert replica_options(cuda)["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 1}
    # the replicas' malloc: tcmalloc preloaded where the machine has it (actors/allocator.py)
    auto = replica_options(replace(cpu, allocator="auto"))["ray_actor_options"]
    assert auto.get("runtime_env") == (
        {"env_vars": preload_env("auto")} if find_tcmalloc() else None
    )
    # a tp engine's GPUs are its workers' bundles (placement_options), not the replica's
    tp = ServeConfig(
        engine=EngineConfig(dtype="float32", model="m", device="cuda", tensor_parallel_size=2)
    )
    assert "num_gpus" not in replica_options(tp)["ray_actor_options"]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--num-replicas", "2", "--min-replicas", "1"], "--min-replicas"),
        (["--num-replicas", "2", "--max-replicas", "3"], "--max-replicas"),
        (["--min-replicas", "3", "--max-replicas", "2"], "--min-replicas"),
        (["--num-replicas", "0"], "--num-replicas"),
        (["--max-replicas", "0"], "--max-replicas"),
        (["--min-replicas", "0", "--max-replicas", "2"], "--min-replicas"),
        (["--min-replicas", "2"], "--min-replicas"),
        (["--target-ongoing-requests", "4"], "--target-ongoing-requests"),
        (["--max-replicas", "2", "--target-ongoing-requests", "0"], "--target-ongoing-requests"),
    ],
)
def test_command_exits_2_naming_the_flag(
    flags: list[str], named: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="raypack.serve"):
        assert serve_main(["--model", "m", *flags]) == 2  # before any Ray
    assert named in caplog.text


def test_command_quiets_rays_token_auth_notice(caplog: pytest.LogCaptureFixture) -> None:
    """A clean start prints no warning: Ray's notice that a new local cluster has token
    authentication on (the safe default: pipeline/commands/console.py) is not shown, from Ray's own
    function; the command sets this up first, so a bad flag's exit shows it too."""
    from ray._private.authentication import authentication_token_setup

    auth = logging.getLogger(TOKEN_AUTH_LOGGER)
    level = auth.level
    auth.setLevel(logging.NOTSET)  # as in a fresh process (other tests' commands set it)
    try:
        assert serve_main(["--model", "m", "--min-replicas", "2"]) == 2  # before any Ray
        caplog.clear()
        with caplog.at_level(logging.INFO):
            authentication_token_setup._warn_token_auth_enabled()
        assert "Token authentication" not in caplog.text
    finally:
        auth.setLevel(level)


# --- two live replicas ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_replicas_both_answer_like_hf_generate(two_replicas: str, tiny_model_dir: Path) -> None:
    from ray import serve

    deployment = serve.status().applications[TWO_REPLICAS].deployments["raypack-openai"]
    states = {getattr(state, "value", state): n for state, n in deployment.replica_states.items()}
    assert states == {"RUNNING": 2}

    hf = HFReference(tiny_model_dir)
    expected = {p: hf.greedy(p, 10).text for p in PROMPTS}

    def ask(prompt: str) -> tuple[str, str]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0}
        answer = requests.post(f"{two_replicas}/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.headers[REPLICA_HEADER], answer.json()["choices"][0]["text"]

    answers: dict[str, dict[str, str]] = {}  # replica -> prompt -> text

    def both_answered_one_prompt() -> bool:
        return len(answers) == 2 and bool(set.intersection(*(set(a) for a in answers.values())))

    deadline = time.monotonic() + 180  # hang guard: Serve's router spreads concurrent requests
    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        while not both_answered_one_prompt():
            assert time.monotonic() < deadline, f"replicas seen: {sorted(answers)}"
            for prompt, (replica, text) in zip(PROMPTS, pool.map(ask, PROMPTS), strict=True):
                answers.setdefault(replica, {})[prompt] = text
            assert len(answers) <= 2, sorted(answers)
    # every answer of either replica is HF's greedy text, so the replicas agree token for token
    for replica, seen in answers.items():
        for prompt, text in seen.items():
            assert text == expected[prompt], (replica, prompt)
