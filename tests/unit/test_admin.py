# SPDX-License-Identifier: Apache-2.0
"""The admin API contract (corefleet_client.admin), its server (frontend.adminserver) and the frontend's
fleet registry behind it (frontend.fleet: ranks, counters, resize operations), without vLLM."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from corefleet_client import admin
from corefleet_client.admin import (
    AdminClient,
    AdminError,
    FleetState,
    FleetStatus,
    RankState,
    RankStatus,
    ResizeOperation,
    ResizePhase,
    ResizeRank,
    ResizeRequest,
)
from corefleet_client.frontend import __main__ as frontend_main
from corefleet_client.frontend.adminserver import AdminServer

TOKEN = "s3cret-token"
STATUS = FleetStatus(
    state=FleetState.DEGRADED, model="tiny", data_parallel_size=2, vllm_version="0.32.0",
    ranks=(RankStatus(rank=0, identity="0000", state=RankState.SERVING, waiting=1, running=2, kv_cache_usage=0.25,
                      in_flight=3, requests_total=10, aborts_total=1),
           RankStatus(rank=1, identity="0100", state=RankState.DEAD, failed_total=2,
                      message="connection to the engine lost (Host unreachable)")),
    message="rank 1: connection to the engine lost (Host unreachable)",
    resize=ResizeOperation(id="r1", from_replicas=2, to_replicas=3, phase=ResizePhase.FAILED,
                           ranks=(ResizeRank(2, RankState.FAILED, "did not join"),), started_at=1.5, finished_at=9.0,
                           drain_timeout_s=10, join_timeout_s=30, error="did not join", message="failed"),
)


class Static:
    """A backend that only answers the fleet snapshot."""

    def snapshot(self) -> FleetStatus:
        return STATUS

    def start_resize(self, request: ResizeRequest) -> tuple[bool, ResizeOperation]:
        raise AssertionError("not called")

    def resize(self, resize_id: str) -> ResizeOperation | None:
        return None

    def stalled_for(self) -> float:
        raise AssertionError("not called")

    def resizes(self) -> list[ResizeOperation]:
        return []

    def cancel_resize(self, resize_id: str, reason: str) -> ResizeOperation:
        raise AssertionError("not called")

    def commit_resize(self, resize_id: str) -> ResizeOperation:
        raise AssertionError("not called")

    def orphan_resize(self, resize_id: str, reason: str) -> ResizeOperation:
        raise AssertionError("not called")


@pytest.fixture
def server() -> Iterator[AdminServer]:
    srv = AdminServer("127.0.0.1", 0, TOKEN, Static())
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def test_rank_status_reads_what_an_older_or_newer_frontend_writes() -> None:
    unresponsive = RankStatus(rank=1, identity="0100", state=RankState.UNRESPONSIVE, message="no answer", since=12.5)
    wire = json.loads(json.dumps(unresponsive.__dict__ | {"state": "Unresponsive"}))
    assert RankStatus.from_json(wire) == unresponsive
    older = {k: v for k, v in wire.items() if k != "since"}
    assert RankStatus.from_json(older).since is None
    assert RankStatus.from_json(wire | {"a_later_field": 1}) == unresponsive


def test_status_round_trips_through_json() -> None:
    wire = json.loads(json.dumps(STATUS.to_json()))
    assert FleetStatus.from_json(wire) == STATUS
    assert wire["ranks"][1]["state"] == "Dead"
    assert STATUS.rank(1).failed_total == 2
    with pytest.raises(KeyError):
        STATUS.rank(5)


def test_client_reads_the_status_with_the_token(server: AdminServer) -> None:
    assert AdminClient(f"http://127.0.0.1:{server.port}", TOKEN).fleet() == STATUS


@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {TOKEN}", f"Bearer {TOKEN}x", "Bearer "])
def test_requests_without_the_right_token_get_401(server: AdminServer, header: str | None) -> None:
    headers = {admin.AUTH_HEADER: header} if header is not None else {}
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{admin.FLEET_PATH}", headers=headers)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=5)
    assert err.value.code == 401
    assert err.value.headers["WWW-Authenticate"].startswith("Bearer")
    assert "model" not in json.loads(err.value.read())  # nothing of the fleet leaks


def test_health_needs_no_token_and_unknown_paths_are_404(server: AdminServer) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{admin.HEALTH_PATH}", timeout=5) as r:
        assert r.status == 200
    client = AdminClient(f"http://127.0.0.1:{server.port}", TOKEN)
    with pytest.raises(AdminError) as err:
        client._get("/v1/nothing")
    assert err.value.status == 404


def test_token_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(admin.ENV_ADMIN_TOKEN_FILE, raising=False)
    monkeypatch.delenv(admin.ENV_ADMIN_TOKEN, raising=False)
    with pytest.raises(ValueError, match="no admin token"):
        admin.read_token()
    monkeypatch.setenv(admin.ENV_ADMIN_TOKEN, "from-env")
    assert admin.read_token() == "from-env"
    f = tmp_path / "token"
    f.write_text("from-file\n")
    monkeypatch.setenv(admin.ENV_ADMIN_TOKEN_FILE, str(f))
    assert admin.read_token() == "from-file"  # the file wins over the variable
    g = tmp_path / "other"
    g.write_text("  explicit  \n")
    assert admin.read_token(str(g)) == "explicit"  # an explicit file wins over both
    g.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        admin.read_token(str(g))


def test_frontend_refuses_bad_launcher_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(admin.ENV_ADMIN_TOKEN_FILE, raising=False)
    monkeypatch.delenv(admin.ENV_ADMIN_TOKEN, raising=False)
    with pytest.raises(SystemExit) as exit_:
        frontend_main.main(["--coordinator-address", "c"])
    assert exit_.value.code == 2
    assert "must follow '--'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        frontend_main.main(["--coordinator-address", "c", "--liveness-timeout", "0", "--", "m"])
    assert exit_.value.code == 2
    assert "must be positive" in capsys.readouterr().err
    # No token: refused before vLLM is even imported, and the admin API never runs open.
    assert frontend_main.main(["--coordinator-address", "c", "--admin-token-file", str(tmp_path / "nope"),
                               "--", "m"]) == 2
    assert "nope" in capsys.readouterr().err
