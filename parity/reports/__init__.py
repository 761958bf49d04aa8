"""Reports: the report files a run writes and their renderers (table, JSON, JUnit, text, plot)."""
