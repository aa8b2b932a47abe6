# SPDX-License-Identifier: Apache-2.0
"""The fleet's frontend: vLLM's OpenAI API server over corefleet's Kubernetes DPLB client, plus the admin API.

Run it as `python -m corefleet_client.frontend` (`__main__`: corefleet's flags, then `serve`). The
modules, from the entrypoint down (each imports only modules below it: import-linter contracts in
pyproject.toml):

* `serve`: vLLM's serve flags, the fleet registry, corefleet's vLLM changes, the servers;
* `client`: `KubeDPLBClient`, vLLM's client subclass: its overrides and the components' wiring;
* `operations`: resize operations on vLLM's event loop, each run by its component;
* components: `elastic` (an MoE fleet's resizes), `replace` (a dense fleet's Dead ranks replaced),
  `resize` (a dense fleet's resizes, and the drain), `liveness` (Dead and Unresponsive ranks),
  `progress` (when a rank that makes no progress is Stalled), `rescue` (a Stalled rank's requests that have not
  started, sent to another rank);
* `membership` (the one interface to the client's routing tables) and `handshake` (the engines'
  HELLO/INIT/READY);
* `stats` (AsyncLLM's stat loggers for a changing fleet), `metrics` (corefleet's `/metrics`
  series), `adminserver` (the authenticated admin API; contract: `corefleet_client.admin`);
* `fleet`: the registry of ranks and resize operations, shared with the admin server's threads;
* `types`: options, errors and other shared types (a leaf).
"""
