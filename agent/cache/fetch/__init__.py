"""``spotdrain cache fetch``: one model copied whole into ``<cache>/models/NAME``.

sources (what the source names and lists, pure), listing (S3 and mirror listings), parts (the part plan and the
progress record, pure), transfer (ranged GETs written at their offsets), verify (sizes, checksums, safetensors
headers), staging (lock, staging directories, publishing), progress (bar, log lines, summary), run (the command).
"""
