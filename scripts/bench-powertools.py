#!/usr/bin/env python3
"""AWS Powertools for Python's idempotent_function on its Redis persistence layer: first calls/s
and replays/s, single-threaded, the Redis commands each costs (by name), and the CPU per call of
this process and of redis-server (--redis-pid, read from /proc/<pid>/stat).

Run by `http-payments bench` (the Rust side of the comparison runs in the same command against
the same Redis); by hand: python3 scripts/bench-powertools.py --redis redis://127.0.0.1:6379
Needs `pip install "aws-lambda-powertools[redis]"`. Prints one JSON object on stdout.
"""

import argparse
import json
import os
import time
import warnings

import redis
from aws_lambda_powertools.utilities.idempotency import (
    IdempotencyConfig,
    idempotent_function,
)
from aws_lambda_powertools.utilities.idempotency.persistence.cache import (
    CachePersistenceLayer,
)


class FakeLambdaContext:
    """The one method Powertools asks of a Lambda context: 15 minutes left, always."""

    def get_remaining_time_in_millis(self) -> int:
        return 900_000


def command_calls(client: redis.Redis) -> dict[str, int]:
    """Commands the server has run by name, all clients together (INFO commandstats)."""
    stats = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()}


def commands_per(before: dict[str, int], after: dict[str, int], ops: int) -> dict[str, float]:
    """What ran between two readings, per operation, without the INFO that took the first."""
    ran = {k: (n - before.get(k, 0)) / ops for k, n in after.items() if k != "info"}
    return {k: v for k, v in sorted(ran.items()) if v > 0}


def cpu_micros(pid: int | None) -> int:
    """utime + stime of a process from /proc/<pid>/stat, in µs (100 ticks per second)."""
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return (int(fields[11]) + int(fields[12])) * 10_000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis", default="redis://127.0.0.1:6379")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--count-ops", type=int, default=500)
    parser.add_argument("--redis-pid", type=int, default=None)
    args = parser.parse_args()

    client = redis.Redis.from_url(args.redis)
    # Every command redis-py sends outside a pipeline goes through execute_command: one round
    # trip each. (Powertools uses no pipelines.)
    round_trips = [0]
    send = client.execute_command

    def counting(*a, **k):
        round_trips[0] += 1
        return send(*a, **k)

    client.execute_command = counting
    info = redis.Redis.from_url(args.redis)
    # Records kept ten minutes (the default is an hour), no local cache (every replay asks Redis).
    config = IdempotencyConfig(expires_after_seconds=600)
    # 3.x warns that the Redis class moves in 4.0; the behaviour measured is the same.
    warnings.simplefilter("ignore", DeprecationWarning)
    persistence = CachePersistenceLayer(client=client)
    # What a Lambda handler does first; without it every call warns that the remaining time
    # is unknown.
    config.register_lambda_context(FakeLambdaContext())
    run = f"{os.getpid()}-{time.time_ns()}"

    @idempotent_function(
        data_keyword_argument="order", config=config, persistence_store=persistence
    )
    def charge(order: dict) -> dict:
        return {"order_id": order["id"], "status": "charged", "amount_cents": order["amount_cents"]}

    def first_calls(prefix: str, seconds: float, limit: int | None = None) -> tuple[int, float]:
        n = 0
        start = time.perf_counter()
        deadline = start + seconds
        while (limit is None and time.perf_counter() < deadline) or (limit is not None and n < limit):
            charge(order={"id": f"{run}-{prefix}-{n}", "amount_cents": 1250})
            n += 1
        return n, time.perf_counter() - start

    replay_order = {"id": f"{run}-replay", "amount_cents": 1250}
    charge(order=replay_order)

    def replays(seconds: float, limit: int | None = None) -> tuple[int, float]:
        n = 0
        start = time.perf_counter()
        deadline = start + seconds
        while (limit is None and time.perf_counter() < deadline) or (limit is not None and n < limit):
            charge(order=replay_order)
            n += 1
        return n, time.perf_counter() - start

    # The floor of any call that needs one round trip: PING, one at a time.
    pings = 0
    start = time.perf_counter()
    while time.perf_counter() < start + min(args.seconds, 1.0):
        info.ping()
        pings += 1
    pings_per_s = pings / (time.perf_counter() - start)

    # Warm-up, then the timed legs, then a counted leg each for the commands per call.
    first_calls("warm", 0.3)
    replays(0.3)
    cpu0 = (time.process_time(), cpu_micros(args.redis_pid))
    n_first, t_first = first_calls("first", args.seconds)
    cpu1 = (time.process_time(), cpu_micros(args.redis_pid))
    n_replay, t_replay = replays(args.seconds)
    cpu2 = (time.process_time(), cpu_micros(args.redis_pid))

    before, trips_before = command_calls(info), round_trips[0]
    first_calls("count", 0.0, args.count_ops)
    middle, trips_middle = command_calls(info), round_trips[0]
    replays(0.0, args.count_ops)
    after, trips_after = command_calls(info), round_trips[0]
    mix_first = commands_per(before, middle, args.count_ops)
    mix_replay = commands_per(middle, after, args.count_ops)

    import aws_lambda_powertools

    print(
        json.dumps(
            {
                "powertools": getattr(aws_lambda_powertools, "__version__", "?"),
                "redis_py": redis.__version__,
                "first_per_s": n_first / t_first,
                "replay_per_s": n_replay / t_replay,
                "first_calls": n_first,
                "replays": n_replay,
                "round_trips_per_first": (trips_middle - trips_before) / args.count_ops,
                "round_trips_per_replay": (trips_after - trips_middle) / args.count_ops,
                "pings_per_s": pings_per_s,
                "commands_per_first": sum(mix_first.values()),
                "commands_per_replay": sum(mix_replay.values()),
                "mix_first": mix_first,
                "mix_replay": mix_replay,
                "client_cpu_us_first": (cpu1[0] - cpu0[0]) * 1e6 / max(n_first, 1),
                "client_cpu_us_replay": (cpu2[0] - cpu1[0]) * 1e6 / max(n_replay, 1),
                "redis_cpu_us_first": (cpu1[1] - cpu0[1]) / max(n_first, 1),
                "redis_cpu_us_replay": (cpu2[1] - cpu1[1]) / max(n_replay, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
