# SPDX-License-Identifier: Apache-2.0
"""The operator's calls to a fleet frontend's admin API (the only way it talks to a fleet's processes).

The planner decides (`StartResize`, `CancelResize`) and reads (`FrontendObs`); this module makes
the HTTP calls with the contract's client (`corefleet_client.admin`, standard library only), each
bounded by a timeout and run off kopf's event loop. The admin API is reached at the frontend pod's
address on its fixed admin port, with the bearer token from the fleet's admin Secret.

While the fleet runs, the operator also reads the frontend's view of its ranks (`fleet`, every
`planner.FRONTEND_POLL_SECONDS`): a rank the frontend reports Dead, or Unresponsive for long, is a loss.

A replacement of lost dense ranks in place is a StartResize that keeps the size and names the ranks
(`StartResize.replace`, sent as `ResizeRequest.replace`); the frontend accepts it only for ranks it
reports Dead, so the planner sends it only then: `observe` of an operation the frontend does not know yet
reads its view of the ranks along (`FrontendObs.fleet`).

A StartResize the frontend refuses (400, 409 for another resize, 503 while it cannot resize) is
remembered per resize id and reported by the next `observe` of that id, so the planner can fail the
resize with the frontend's reason instead of asking again every second.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import TypeVar

from corefleet_client.admin import FLEET_PATH, AdminClient, AdminError, ResizeRequest
from corefleet_operator import constants
from corefleet_operator.actions import CancelResize, StartResize
from corefleet_operator.observe import FleetObs, FrontendObs, PodObs, fleet_obs, resize_obs

logger = logging.getLogger(__name__)

ADMIN_TIMEOUT_SECONDS = 5.0
NO_ADDRESS = "the frontend pod has no address yet"
T = TypeVar("T")


def admin_url(pod: PodObs) -> str:
    host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
    return f"http://{host}:{constants.FRONTEND_ADMIN_PORT}"


def _reason(e: AdminError) -> str:
    try:
        return str(json.loads(e.body).get("error") or e.body)
    except (ValueError, AttributeError):
        return e.body


class FrontendAPI:
    """Admin API calls for one fleet (one per reconciler)."""

    def __init__(self, timeout: float = ADMIN_TIMEOUT_SECONDS) -> None:
        self.timeout = timeout
        self._refused: dict[str, str] = {}  # resize id -> why the frontend refused to start it

    def _client(self, pod: PodObs, token: str) -> AdminClient:
        return AdminClient(admin_url(pod), token, timeout=self.timeout)

    async def _read(self, pod: PodObs, token: str, call: Callable[[AdminClient], T]) -> tuple[T | None, str]:
        """`call` on the pod's admin API off the event loop: (its answer, "") or (None, why it failed)."""
        try:
            return await asyncio.to_thread(call, self._client(pod, token)), ""
        except AdminError as e:
            return None, f"admin API answered {e.status}: {_reason(e)}"
        except (OSError, ValueError, KeyError) as e:
            return None, f"admin API at {admin_url(pod)}: {e}"

    async def observe(self, pod: PodObs | None, token: str, resize_id: str) -> FrontendObs:
        """What the frontend says of `resize_id`."""
        if pod is None:
            return FrontendObs(reachable=False, error=NO_ADDRESS)
        op, error = await self._read(pod, token, lambda client: client.resize(resize_id))
        if error:
            return FrontendObs(reachable=False, error=error)
        if op is None:
            refused = self._refused.get(resize_id, "")
            view = None if refused else await self.fleet(pod, token)  # a replacement waits for its ranks Dead
            return FrontendObs(reachable=True, refused=refused, fleet=view)
        return FrontendObs(reachable=True, resize=resize_obs(op.to_json()))

    async def fleet(self, pod: PodObs | None, token: str) -> FleetObs:
        """The frontend's view of the fleet's ranks (`GET /v1/fleet`), read leniently (`observe.fleet_obs`): the
        raw JSON, not `AdminClient.fleet()`, so a rank state added to the frontend later is not an error here."""
        if pod is None:
            return FleetObs(reachable=False, error=NO_ADDRESS)
        body, error = await self._read(pod, token, AdminClient.fleet_json)
        if error:
            return FleetObs(reachable=False, error=error)
        if not isinstance(body, dict):
            return FleetObs(reachable=False, error=f"admin API at {admin_url(pod)}: {FLEET_PATH} is not an object")
        return fleet_obs(body)

    async def start(self, pod: PodObs | None, token: str, action: StartResize) -> None:
        if pod is None:
            logger.warning("resize %s: the frontend pod has no address yet; asking again later", action.resize_id)
            return
        request = ResizeRequest(id=action.resize_id, replicas=action.replicas, drain_timeout_s=action.drain_timeout_s,
                                join_timeout_s=action.join_timeout_s, replace=action.replace, vacate=action.vacate,
                                idle=action.idle)
        try:
            started, op = await asyncio.to_thread(self._client(pod, token).start_resize, request)
        except AdminError as e:
            reason = _reason(e)
            logger.warning("resize %s: the frontend refused it (%d): %s", action.resize_id, e.status, reason)
            if e.status in (400, 409, 503):
                self._refused[action.resize_id] = f"the frontend refused it ({e.status}): {reason}"
            return
        except (OSError, ValueError) as e:
            logger.warning("resize %s: cannot reach the frontend's admin API: %s", action.resize_id, e)
            return
        logger.info("resize %s: %s on the frontend (%s)", action.resize_id, "started" if started else "known",
                    op.phase)

    async def cancel(self, pod: PodObs | None, token: str, action: CancelResize) -> None:
        if pod is None:
            return
        try:
            await asyncio.to_thread(self._client(pod, token).cancel_resize, action.resize_id, action.reason)
        except AdminError as e:
            if e.status == 404:  # never started there (or that frontend is new): nothing runs under that id
                logger.info("resize %s: nothing to cancel, the frontend does not know it", action.resize_id)
            else:
                logger.warning("resize %s: cancel answered %d: %s", action.resize_id, e.status, _reason(e))
        except (OSError, ValueError) as e:
            logger.warning("resize %s: cannot reach the frontend's admin API to cancel: %s", action.resize_id, e)
