"""Speculative decoding: a sequence drafts a few tokens cheaply, runs its next token and the drafts
through the model in one pass (whose experts are the union of theirs, loaded once), and keeps the
drafts that the target model would have produced itself.

- `config`: what `--speculate` asks for (`Speculation`) and which families can take it;
- `ngram`: prompt-lookup drafts (`NgramDrafter`);
- `oracle`: drafts of a set acceptance from a known answer, for benchmarks (`DraftOracle`);
- `controller`: how many drafts each pass of `--speculate auto` verifies (`DraftController`);
- `verify`: the acceptance rule, exact at temperature 0 and distribution-preserving when sampling.

`generation.Sequence` runs the verification pass and rolls its cache back to the accepted tokens."""
