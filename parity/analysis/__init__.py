"""Analysis: leaf diffs and tolerance tiers, facts read off compiled HLO, program diffs,
initialisation statistics."""
