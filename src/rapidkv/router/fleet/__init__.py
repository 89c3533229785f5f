"""The instances a router dispatches to (`fleet.Fleet`), and the parts it is
made of:

- `balance`: least-outstanding choice, ties in turn (pure);
- `health`: up and down, and why (pure);
- `membership_diff`: the fleet's etcd records in, joins, restarts and
  departures out (pure);
- `transfers`: whether a decode instance's transfers work, from its
  connector's counters (pure); `transfer_watcher` reads those counters;
- `discovery`: an instance asked over HTTP where its control plane listens
  (and its block size, max_num_seqs, identity, KV-event publisher, model
  directory); `addresses` keeps those answers;
- `prefix_caches`: the prefix index fed by each member's KV events, looked up
  per request;
- `fleet`: `Fleet`, the shell over them all (members, pools, outstanding
  counts, health probes, draining, following etcd).
"""
