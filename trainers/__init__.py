"""TRL trainers that use the chunked losses."""
