"""Command-line flags for serving (shared by jobs/serve.py and benchmarks/bench_serve.py), and
the same flags as Ray Serve app-builder arguments (`serve run pipeline.serve:build_app
model=... num_replicas=2`, or `args:` in a `serve deploy` config file)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import NoReturn

from actors.allocator import ALLOCATORS
from packing.admission import POLICIES, AdmissionConfig
from pipeline.chat_template import read_chat_template
from pipeline.engine_flags import add_engine_flags, engine_config_from_args
from pipeline.serve.config import API_KEYS_ENV, ServeConfig
from pipeline.serve.replicas import Replicas

# `raypack serve` flags that are not the app's: Serve's own config sets them for `serve run`
# and `serve deploy` (http_options, the cluster address).
COMMAND_ONLY = ("host", "port", "address", "ray_num_cpus")


def add_app_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag that shapes the app (all of `raypack serve`'s but where it listens)."""
    add_engine_arguments(parser)
    add_admission_arguments(parser)
    add_limit_arguments(parser)
    add_replica_arguments(parser)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, engine and parallelism flags (pipeline/engine_flags.py, shared with the offline
    job), plus the name clients pass as `model`."""
    group = add_engine_flags(parser)
    group.add_argument(
        "--served-model-name",
        default=None,
        help="name clients pass as `model` (default: the model folder's name)",
    )
    group.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="the engine's device; cuda: one GPU per replica (default: cuda when the Ray "
        "cluster the app is built on has GPUs)",
    )


def add_admission_arguments(parser: argparse.ArgumentParser) -> None:
    """Admission policy and controller knobs (see packing/admission.py)."""
    d = AdmissionConfig()
    group = parser.add_argument_group("admission")
    group.add_argument("--policy", choices=POLICIES, default=d.policy, help="admission policy")
    group.add_argument("--window-requests", type=int, default=d.window_requests, help="fixed: N")
    group.add_argument("--window-ms", type=float, default=d.window_s * 1e3, help="fixed: T (ms)")
    group.add_argument("--n-min", type=int, default=d.n_min, help="aimd: lower bound of N_t")
    group.add_argument("--n-max", type=int, default=d.n_max, help="aimd: upper bound of N_t")
    group.add_argument("--alpha", type=float, default=d.alpha, help="aimd: additive increase")
    group.add_argument("--beta", type=float, default=d.beta, help="aimd: multiplicative decrease")
    group.add_argument(
        "--ttft-low-ms", type=float, default=d.ttft_low_s * 1e3, help="aimd: band low edge"
    )
    group.add_argument(
        "--ttft-high-ms", type=float, default=d.ttft_high_s * 1e3, help="aimd: band high edge"
    )
    group.add_argument(
        "--burst-queue-depth", type=int, default=d.burst_queue_depth, help="aimd: burst depth"
    )
    group.add_argument(
        "--burst-arrival-rate",
        type=float,
        default=d.burst_arrival_rate,
        help="aimd: burst arrival rate (requests/s)",
    )
    group.add_argument(
        "--max-wait-ms", type=float, default=d.max_wait_s * 1e3, help="aimd: longest wait (ms)"
    )


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """Protective limits and API keys."""
    d = ServeConfig()
    group = parser.add_argument_group("limits")
    group.add_argument("--max-waiting", type=int, default=d.max_waiting, help="staging capacity")
    group.add_argument(
        "--max-queue-wait",
        type=_seconds_or_none,
        default=d.max_queue_wait_s,
        help="seconds a request may wait for the engine before a 429, or 'none' for no limit "
        f"(default: {d.max_queue_wait_s:g})",
    )
    group.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="body limit")
    group.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="prompt token limit (default: the context length minus one)",
    )
    group.add_argument(
        "--max-tokens-limit", type=int, default=d.max_tokens_limit, help="max_tokens limit"
    )
    group.add_argument(
        "--api-keys-env", default=API_KEYS_ENV, help="env var with comma-separated API keys"
    )
    group.add_argument("--api-keys-file", default=None, help="file with one API key per line")
    group.add_argument(
        "--num-cpus",
        type=float,
        default=d.num_cpus,
        help="CPUs for each replica (default: fitted to the Ray cluster, (CPUs - the routing "
        "front's 0.1) / replicas, at most 1; more than the cluster has exits 2)",
    )
    group.add_argument(
        "--allocator",
        choices=ALLOCATORS,
        default=d.allocator,
        help="the replicas' malloc: tcmalloc where the machine has it (auto), tcmalloc (exit 2 "
        "without it), or the system's",
    )
    group.add_argument(
        "--body-timeout-s", type=float, default=d.body_timeout_s, help="whole body within (408)"
    )
    group.add_argument(
        "--max-slow-bodies-per-client",
        type=int,
        default=d.max_slow_bodies_per_client,
        help="bodies still arriving per client address (429 beyond)",
    )
    group.add_argument(
        "--max-slow-bodies", type=int, default=d.max_slow_bodies, help="slow bodies in all"
    )
    group.add_argument(
        "--max-requests-per-client",
        type=int,
        default=None,
        help="requests in progress per client address (429 beyond); default: no cap",
    )
    group.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=None,
        help="Serve's max_ongoing_requests; default: staging + engine + slow bodies + 64",
    )
    group.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="requests Serve's proxy holds until a replica takes them (503 with Retry-After "
        "beyond, Serve's back-pressure; Serve counts requests being routed too); default: "
        "--max-ongoing-requests x replicas; -1: no limit",
    )
    group.add_argument(
        "--allow-special-tokens-in-messages",
        action="store_true",
        help="tokenize special-token text inside chat messages (e.g. <|im_end|>) as the token; "
        "by default it is plain text, so a client cannot forge a chat turn",
    )
    group.add_argument(
        "--chat-template",
        help="a chat template (Jinja) file, or its text, used instead of the tokenizer's "
        "(a request's chat_template field overrides it, with --trust-request-chat-template)",
    )
    group.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let a request's chat_template field replace the server's (a client's Jinja runs "
        "in the replica); by default such a request is a 400, as in vLLM",
    )


def add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    """A fixed replica count, or Ray Serve's autoscaling between bounds."""
    group = parser.add_argument_group("replicas (each with its own engine)")
    group.add_argument("--num-replicas", type=int, default=None, help="a fixed count (default: 1)")
    group.add_argument(
        "--min-replicas",
        type=int,
        default=None,
        help="autoscaling: fewest replicas (default: 1; needs --max-replicas)",
    )
    group.add_argument(
        "--max-replicas", type=int, default=None, help="autoscaling: most replicas (turns it on)"
    )
    group.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=None,
        help="autoscaling: requests in progress per replica to aim at "
        "(default: --max-num-seqs, what one engine runs at once)",
    )
    group.add_argument(
        "--no-prefix-routing",
        action="store_true",
        help="with more than one replica, route by Serve's default (power of two choices) "
        "instead of sending requests that share a prefix to the replica holding it",
    )


def admission_from_args(args: argparse.Namespace, **overrides: object) -> AdmissionConfig:
    """The AdmissionConfig the flags describe (with `overrides` applied)."""
    values: dict[str, object] = dict(
        policy=args.policy,
        window_requests=args.window_requests,
        window_s=args.window_ms / 1e3,
        n_min=args.n_min,
        n_max=args.n_max,
        alpha=args.alpha,
        beta=args.beta,
        ttft_low_s=args.ttft_low_ms / 1e3,
        ttft_high_s=args.ttft_high_ms / 1e3,
        burst_queue_depth=args.burst_queue_depth,
        burst_arrival_rate=args.burst_arrival_rate,
        max_wait_s=args.max_wait_ms / 1e3,
    )
    values.update(overrides)
    return AdmissionConfig(**values)  # type: ignore[arg-type]


def serve_config_from_args(
    args: argparse.Namespace, admission: AdmissionConfig | None = None
) -> ServeConfig:
    """The ServeConfig the flags describe; ValueError names a bad flag value."""
    engine = engine_config_from_args(args, device=args.device)
    return ServeConfig(
        engine=engine,
        admission=admission or admission_from_args(args),
        served_model_name=args.served_model_name,
        max_waiting=args.max_waiting,
        max_queue_wait_s=args.max_queue_wait,
        max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_limit=args.max_tokens_limit,
        api_keys_env=args.api_keys_env or None,
        api_keys_file=args.api_keys_file,
        num_cpus=args.num_cpus,
        allocator=args.allocator,
        body_timeout_s=args.body_timeout_s,
        max_slow_bodies_per_client=args.max_slow_bodies_per_client,
        max_slow_bodies=args.max_slow_bodies,
        max_requests_per_client=args.max_requests_per_client,
        max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=args.max_queued_requests,
        allow_special_tokens_in_messages=args.allow_special_tokens_in_messages,
        chat_template=read_chat_template(args.chat_template) if args.chat_template else None,
        trust_request_chat_template=args.trust_request_chat_template,
        replicas=Replicas(
            num_replicas=args.num_replicas,
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            target_ongoing_requests=args.target_ongoing_requests,
        ),
        prefix_routing=not args.no_prefix_routing,
    )


class _RaisingParser(argparse.ArgumentParser):
    """A parser whose errors are ValueErrors (an app builder must not exit its process)."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def serve_config_from_app_args(app_args: Mapping[str, object]) -> ServeConfig:
    """The ServeConfig of Ray Serve app-builder arguments: each `key=value` is the flag
    `--key value` of `raypack serve` (dashes or underscores), typed and validated as the flag
    is; a switch (`no_prefix_caching`) takes true/false. ValueError names a bad argument."""
    parser = _RaisingParser(prog="pipeline.serve:build_app", add_help=False, allow_abbrev=False)
    add_app_arguments(parser)
    options = parser._option_string_actions
    argv: list[str] = []
    for key, value in app_args.items():
        name = str(key).replace("_", "-")
        if name.replace("-", "_") in COMMAND_ONLY:
            raise ValueError(
                f"argument {key!r} is `raypack serve`'s; with Serve's CLI set it in Serve's own"
                " config (http_options, the cluster address)"
            )
        action = options.get(f"--{name}")
        if action is None:
            raise ValueError(f"unknown argument {key!r} (the flags of `raypack serve --help`)")
        if value is None:
            continue
        if action.nargs == 0:  # a switch
            if _truth(key, value):
                argv.append(f"--{name}")
        else:
            argv.append(f"--{name}={value}")  # one token: a value may start with '-'
    return serve_config_from_args(parser.parse_args(argv))


def _seconds_or_none(text: str) -> float | None:
    """A number of seconds, or None for 'none' (no limit)."""
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected seconds (a number) or 'none', got {text!r}"
        ) from None


def _truth(key: object, value: object) -> bool:
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"argument {key!r} is a switch: true or false, got {value!r}")
