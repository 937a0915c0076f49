"""This machine's processes: our own Ray head, process facts, free ports, test probes."""
