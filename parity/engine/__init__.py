"""The framework-neutral parity engine: a `Pair` of `Side`s, checks written once over it, and
`CheckResult`. Nothing here knows the decoder or which framework a side is."""
