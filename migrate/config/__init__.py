"""The typed, validated config: its keys and coercion (contract), cross-key rules, loading (YAML
and overrides), sane bounds, bounded YAML."""
