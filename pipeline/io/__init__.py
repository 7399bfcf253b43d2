"""The job's ends: the input table, the output folder (data, lock, resume, lineage, report)."""
