#!/usr/bin/env python3
"""AWS Powertools for Python's idempotent_function on its Redis persistence layer: first calls/s
and replays/s, single-threaded, and the Redis commands each costs.

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


def total_commands(client: redis.Redis) -> int:
    """Commands the server has run, all clients together (INFO commandstats)."""
    stats = client.info("commandstats")
    return sum(v["calls"] for v in stats.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis", default="redis://127.0.0.1:6379")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--count-ops", type=int, default=500)
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
    n_first, t_first = first_calls("first", args.seconds)
    n_replay, t_replay = replays(args.seconds)

    before, trips_before = total_commands(info), round_trips[0]
    first_calls("count", 0.0, args.count_ops)
    middle, trips_middle = total_commands(info), round_trips[0]
    replays(0.0, args.count_ops)
    after, trips_after = total_commands(info), round_trips[0]
    # Each INFO is itself one command, counted in the next reading.
    per_first = (middle - before - 1) / args.count_ops
    per_replay = (after - middle - 1) / args.count_ops

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
                "commands_per_first": per_first,
                "commands_per_replay": per_replay,
            }
        )
    )


if __name__ == "__main__":
    main()
