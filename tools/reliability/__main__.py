"""The script: a server of its own (or --url), phases 1-3 in rounds, phase 4, the JSON report.
See the package's docstring; run as `python -m tools.reliability`."""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dabba.config import DEMO_MODEL, ServerConfig

from . import __doc__ as SUITE_DOC
from .common import Target, server_limits, served_model
from .fuzz import FuzzConfig, run_fuzz
from .malformed import run_malformed
from .server import ServerProcess
from .soak import SoakConfig, run_soak
from .storm import StormConfig, run_storm

# ---- the script: rounds, the report ------------------------------------------------------------------


@dataclass(frozen=True)
class RunConfig:
    """One run of the script."""

    minutes: float = 0.0
    soak: SoakConfig = SoakConfig()
    storm: StormConfig = StormConfig()
    fuzz: FuzzConfig = FuzzConfig()
    seed: int = 0


def run_rounds(target: Target, config: RunConfig, log: Callable[[str], None],
               after_round: Callable[[], None] = lambda: None) -> tuple[list[dict], int]:
    """Phases 1-3 in rounds until ``config.minutes`` pass (at least one), then phase 4;
    ``after_round`` runs after each round (the script records the server's RSS)."""
    deadline = time.monotonic() + 60 * config.minutes
    phases: list[dict] = []
    rounds = 0
    while True:
        rounds += 1
        seed = config.seed + 1000 * rounds  # each round its own traffic and cases
        for run, phase_config in ((run_soak, dataclasses.replace(config.soak, seed=seed)),
                                  (run_storm, dataclasses.replace(config.storm, seed=seed)),
                                  (run_fuzz, dataclasses.replace(config.fuzz, seed=seed))):
            result = run(target, phase_config)
            phases.append({"round": rounds, **result.to_dict()})
            log(f"round {rounds} {result.phase}: {result.counts} failures={len(result.failures)} "
                f"({result.seconds:.1f} s)")
        after_round()
        if time.monotonic() >= deadline:
            break
    result = run_malformed(target)
    phases.append({"round": rounds, **result.to_dict()})
    log(f"malformed: {result.counts} failures={len(result.failures)}")
    return phases, rounds


def totals(phases: list[dict]) -> dict[str, int]:
    def total(phase: str, key: str) -> int:
        return sum(p.get(key, 0) for p in phases if p["phase"] == phase)

    return {"requests": total("soak", "requests"), "disconnects": total("storm", "disconnects"),
            "fuzz_cases": total("fuzz", "cases"), "malformed_rows": total("malformed", "rows"),
            "server_errors_5xx": sum(p["server_errors"] for p in phases),
            "failures": sum(p["num_failures"] for p in phases)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.reliability", description=SUITE_DOC.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--model", default=DEMO_MODEL, help="the model of the server started here (default: the demo)")
    p.add_argument("--api-key", default=None, help="the key of --url's server (a started one gets a random key)")
    p.add_argument("--minutes", type=float, default=0.0, help="repeat phases 1-3 until this many minutes pass")
    p.add_argument("--clients", type=int, default=4, help="concurrent soak clients (default: 4)")
    p.add_argument("--requests-per-client", type=int, default=6, help="soak requests per client per round")
    p.add_argument("--disconnects", type=int, default=24, help="clients hanging up per round (default: 24)")
    p.add_argument("--fuzz-cases", type=int, default=240, help="schemathesis cases per round (default: 240)")
    p.add_argument("--seed", type=int, default=None, help="seed of the traffic and cases (default: random)")
    # the bounds of a server started here; every check reads the bounds of the server it probes
    p.add_argument("--max-n", type=int, default=8, help="the started server's --max-n")
    p.add_argument("--max-stop-sequences", type=int, default=4, help="the started server's --max-stop-sequences")
    p.add_argument("--max-stop-length", type=int, default=64, help="the started server's --max-stop-length")
    p.add_argument("--max-request-body-bytes", default="1MiB", help="the started server's --max-request-body-bytes")
    p.add_argument("--server-arg", action="append", default=[], help="an extra flag for the started server "
                   "(repeat; default: --dtype float32 --kv-cache-memory 64MiB --log-level warning)")
    p.add_argument("--json-out", default=None, help="also write the report to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from dabba.config_fields import parse_bytes

    limits = ServerConfig(max_n=args.max_n, max_stop_sequences=args.max_stop_sequences,
                          max_stop_length=args.max_stop_length,
                          max_request_body_bytes=parse_bytes(args.max_request_body_bytes))
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    config = RunConfig(minutes=args.minutes, soak=SoakConfig(clients=args.clients,
                                                             requests_per_client=args.requests_per_client),
                       storm=StormConfig(disconnects=args.disconnects), fuzz=FuzzConfig(cases=args.fuzz_cases),
                       seed=seed)

    def log(line: str) -> None:
        print(f"[reliability] {line}", file=sys.stderr, flush=True)

    server: ServerProcess | None = None
    report: dict[str, Any] = {"seed": seed, "minutes": args.minutes}
    started = time.monotonic()
    try:
        if args.url is None:
            api_key = args.api_key or f"sk-{secrets.token_hex(8)}"
            extra = args.server_arg or ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--log-level", "warning"]
            log(f"starting the server for {args.model}")
            server = ServerProcess.start(args.model, limits, api_key, extra)
            url = server.url
            report["server_log"] = str(server.log_path)
        else:
            url, api_key = args.url.rstrip("/"), args.api_key
        target = Target(url=url, model=served_model(url, api_key), api_key=api_key,
                        limits=server_limits(url, api_key))
        report.update(url=url, model=target.model)
        rss_start = server.rss_kib() if server else None
        rss_rounds: list[int | None] = []  # a leak grows round after round; warming up levels off
        phases, rounds = run_rounds(target, config, log,
                                    lambda: rss_rounds.append(server.rss_kib() if server else None))
        rss_end = server.rss_kib() if server else None
        report.update(rounds=rounds, totals=totals(phases), phases=phases,
                      rss_kib={"start": rss_start, "end": rss_end, "after_each_round": rss_rounds})
    finally:
        if server is not None:
            code = server.stop(limits.shutdown_timeout + 60)
            report["server_exit"] = code
            report["server_log_errors"] = server.log_errors()[:20]
            if code != 0:
                report["server_log_tail"] = server.log_tail()
    report["seconds"] = round(time.monotonic() - started, 1)
    ok = (report.get("totals", {}).get("failures", 1) == 0 and report.get("server_exit", 0) == 0
          and not report.get("server_log_errors"))
    if server is not None and ok:  # kept (its path in the report) only when it may explain a failure
        server.log_path.unlink(missing_ok=True)
        report.pop("server_log", None)
    report["ok"] = ok
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
