"""Verification: the Verifier (sample feeds, reference, tolerances, the accuracy budget) and bisection."""
