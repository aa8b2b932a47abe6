# SPDX-License-Identifier: Apache-2.0
"""The planner's second phase: what the current incarnation lost, and whether its configuration changed.

A lost rank is a member pod (coordinator, frontend, engine below the committed size) of the current
incarnation that

* failed (its containers exited),
* vanished from a fleet that was complete,
* is bound but has not been Ready for `readyTimeoutSeconds` (since it was scheduled or last became
  unready: ReadyTimeout), or
* while the fleet serves with no operation in flight, runs while the frontend's admin API reports its
  rank Dead, or Unresponsive for longer than `UNRESPONSIVE_SECONDS` (`Observed.fleet`, read every
  `FRONTEND_POLL_SECONDS`; a state the operator does not know is read as not serving but not dead);

and an operation in flight that lost the fleet (`Flight.lost`) is one too. The ranks and member pods an
operation moves are not lost by their pods' ends (`Flight.moving`, `Flight.moving_members`). What a loss
leads to (a replacement of ranks, or of the frontend and/or coordinator, in place; a new incarnation;
giving the fleet up) is the next step's business (`planner.step`): `Losses.members` names the frontend
and coordinator pods among the losses.

A pod whose configuration hash differs from the spec's (`changed`) means the spec changed (image, model,
engine args, ...; not `replicas`): the fleet is recreated at the new spec.

Pure module: no kopf, no Kubernetes client, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from corefleet_operator import constants
from corefleet_operator.models import FleetRef, MemberRole
from corefleet_operator.observe import FleetObs, Observed, PodObs
from corefleet_operator.planner.basis import Basis
from corefleet_operator.planner.common import parse_time, seconds_between, what
from corefleet_operator.planner.follow import Flight
from corefleet_operator.planner.members import member_role
from corefleet_operator.status import POD_TERMINAL

# The frontend's view of the ranks is read this often while the fleet serves; a rank it reports
# Unresponsive for longer than UNRESPONSIVE_SECONDS (or Dead) while its pod runs is lost.
FRONTEND_POLL_SECONDS = 15.0
UNRESPONSIVE_SECONDS = 60.0

Loss = tuple[int | None, str]  # the engine rank lost (None: the frontend, the coordinator, an operation), and why


@dataclass(frozen=True)
class Losses:
    """This pass's losses in the current incarnation, in the order they are told, and a configuration change."""

    lost: tuple[Loss, ...] = ()
    changed: bool = False  # a pod of the incarnation was built from another configuration
    members: tuple[MemberRole, ...] = ()  # the frontend and/or coordinator among the losses (pods failed, vanished,
    # not ready in time; one loss each)

    @property
    def reason(self) -> str:
        return "; ".join(why for _, why in self.lost)

    @property
    def ranks(self) -> list[int]:
        """The engine ranks lost, ascending."""
        return sorted({rank for rank, _ in self.lost if rank is not None})


def find_losses(fleet: FleetRef, observed: Observed, basis: Basis, flight: Flight, now: str) -> Losses:
    """The losses (failed, vanished, not ready in time, reported dead, lost by the operation) and whether the
    configuration changed."""
    timeout = float(fleet.spec.scaling.readyTimeoutSeconds)
    members = [p for name, p in basis.current.items() if name in basis.members and p.rank not in flight.moving
               and name not in flight.moving_members]
    failed = [p for p in members if p.phase in POD_TERMINAL]
    slow = [p for p in members if unready_too_long(p, timeout, now)]
    old = basis.old
    dead = (frontend_losses(fleet, observed.fleet, basis.current, flight.committed, now)
            if old.phase in ("Running", "Degraded") and basis.running is None and not basis.fresh else [])
    changed = any(p.spec_hash != basis.config_hash for p in basis.current.values())
    # A pod the new configuration adds (another frontend) is not one that vanished: the fleet is recreated for it.
    gone = [] if changed else vanished(fleet, basis, flight)
    lost: list[Loss] = [(lost_rank(fleet, p), describe_loss(p)) for p in failed + gone]
    lost += [(lost_rank(fleet, p), f"{what(p)} (pod {p.name}) not ready {timeout:.0f}s after it was scheduled "
                                   "(ReadyTimeout)") for p in slow]
    lost += dead
    lost += [(None, why) for why in flight.lost]
    names = [p.name for p in failed + slow] + gone
    roles = tuple(role for name in names if (role := member_role(fleet.name, name)) is not None)
    return Losses(lost=tuple(lost), changed=changed, members=roles)


def vanished(fleet: FleetRef, basis: Basis, flight: Flight) -> list[str]:
    """Member pods gone from a fleet that was complete in this incarnation (not those an operation moves)."""
    old = basis.old
    if not (old.phase in ("Running", "Degraded", "Scaling") and old.fleetGeneration == basis.generation):
        return []
    moved = {constants.engine_name(fleet.name, rank) for rank in flight.moving} | flight.moving_members
    return [name for name in sorted(basis.members) if name not in basis.live_by_name and name not in moved]


def unready_too_long(pod: PodObs, timeout: float, now: str) -> bool:
    """A bound pod that has not been Ready for `timeout` seconds (since it was scheduled, or became unready)."""
    return (bool(pod.node) and bool(pod.unready_since) and not pod.ready and not pod.terminating
            and pod.phase not in POD_TERMINAL and seconds_between(pod.unready_since, now) > timeout)


def frontend_losses(fleet: FleetRef, seen: FleetObs | None, current: Mapping[str, PodObs], committed: int,
                    now: str) -> list[Loss]:
    """Ranks the frontend reports Dead, or Unresponsive for longer than UNRESPONSIVE_SECONDS, while their pods run.
    A state the operator does not know is read as not serving but not dead."""
    if seen is None or not seen.reachable:
        return []
    clock = parse_time(now)
    assert clock is not None
    out: list[Loss] = []
    for rank, r in sorted(seen.ranks.items()):
        pod = current.get(constants.engine_name(fleet.name, rank))
        if rank >= committed or pod is None or pod.terminating or pod.phase != "Running":
            continue  # no pod, or one that ended: its own state decides
        why = f": {r.message}" if r.message else ""
        if r.state == "Dead":
            out.append((rank, f"rank {rank} (pod {pod.name}): the frontend reports it Dead{why}"))
        elif r.state == "Unresponsive" and r.since is not None \
                and (quiet := clock.timestamp() - r.since) > UNRESPONSIVE_SECONDS:
            out.append((rank, f"rank {rank} (pod {pod.name}): the frontend reports it Unresponsive for {quiet:.0f}s "
                              f"(over {UNRESPONSIVE_SECONDS:.0f}s){why}"))
    return out


def lost_rank(fleet: FleetRef, pod: PodObs | str) -> int | None:
    """The engine rank a lost pod (or the name of a vanished one) served; None for the frontend or coordinator."""
    if isinstance(pod, PodObs):
        return pod.rank if pod.role == constants.ROLE_ENGINE else None
    prefix = constants.engine_name(fleet.name, 0)[:-1]
    tail = pod[len(prefix):] if pod.startswith(prefix) else ""
    return int(tail) if tail.isdigit() else None


def describe_loss(pod: PodObs | str) -> str:
    """A failed pod, or the name of a vanished one, for the loss's reason."""
    if isinstance(pod, str):
        return f"pod {pod} disappeared"
    why = f": {pod.message}" if pod.message else ""
    return f"{what(pod)} (pod {pod.name}) {pod.phase.lower()}{why}"
