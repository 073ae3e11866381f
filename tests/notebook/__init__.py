"""The notebook surface's tests: widgets driven headless, and the real front ends in a browser."""

BYTES_PER_STEP_BUDGET = 20_000
"""What a live panel may send the page per run step, whatever the kernel is doing: a 1,000-step run then
stays within 20 MB through an SSH tunnel or JupyterHub."""
