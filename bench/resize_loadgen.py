# SPDX-License-Identifier: Apache-2.0
"""The load generator of bench_resize.py, in its own process (its CPU is not the fleet's).

    python bench/resize_loadgen.py TARGET_FILE OUT.jsonl WORKERS MAX_TOKENS MODEL

WORKERS clients send completions one after another, alternately streaming and not, to the
`host:port` in TARGET_FILE (read before every request, so that the benchmark can point them at a
replaced frontend); each request is appended to OUT.jsonl as `[start, end, ok, detail]` (wall
clock). Runs until SIGINT, then lets the requests in flight finish.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from pathlib import Path


def one(target: Path, model: str, i: int, stream: bool, max_tokens: int) -> tuple[bool, str]:
    host, port = target.read_text().strip().split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"model": model, "prompt": f"Request {i}", "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": stream})
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            return False, f"HTTP {r.status}"
        finish = None
        if stream:
            for raw in r:
                line = raw.strip()
                if line.startswith(b"data:") and line != b"data: [DONE]":
                    event = json.loads(line[5:])
                    if "error" in event:
                        return False, "error event"
                    for choice in event.get("choices", ()):
                        finish = choice.get("finish_reason") or finish
        else:
            finish = json.loads(r.read())["choices"][0]["finish_reason"]
        return finish == "length", f"finish {finish}"
    except (OSError, http.client.HTTPException, ValueError) as e:
        return False, type(e).__name__
    finally:
        conn.close()


def main(argv: list[str]) -> int:
    target, out_path, workers, max_tokens, model = Path(argv[0]), argv[1], int(argv[2]), int(argv[3]), argv[4]
    lock = threading.Lock()
    stop = threading.Event()
    with open(out_path, "a", buffering=1) as out:
        def worker(w: int) -> None:
            i = 0
            while not stop.is_set():
                t0 = time.time()
                ok, detail = one(target, model, i, (i + w) % 2 == 0, max_tokens)
                with lock:
                    out.write(json.dumps([t0, time.time(), ok, detail]) + "\n")
                if not ok:
                    stop.wait(0.2)  # the endpoint is down: do not spin
                i += 1

        threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(workers)]
        for t in threads:
            t.start()
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            stop.set()
            for t in threads:
                t.join(60)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
