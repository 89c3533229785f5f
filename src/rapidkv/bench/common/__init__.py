"""What every benchmark shares, one definition each.

- `options`: the command-line options every benchmark takes the same way
  (output, server arguments, streaming usage, dtype);
- `output`: strict JSON, the report's destination, number formatting, figures;
- `provenance`: what ran where (date, git, CPU, vLLM and NIXL versions);
- `progress`: the progress line on stderr;
- `groups`: the served configurations and their server groups (`nixl_tuning`
  and `proxy` serve vLLM's own NIXL baseline);
- `loads`: closed and open loops of streamed requests, one `RequestResult` each;
- `stats`: percentiles, summaries, paired intervals, histograms and the
  token-exact classification against a reference;
- `workloads` and `arrivals`: request length distributions and Poisson
  arrivals (a conversation's first turns only: `session_arrivals`);
- `shared_prefix` and `multiturn`: `bench goodput`'s workloads of shared
  prefixes (groups behind one system prompt; users in conversation);
- `dataset`: prompts (random token ids, ShareGPT).

Nothing here imports a benchmark's own package.
"""
