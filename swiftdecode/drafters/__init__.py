"""Layer 5: where draft tokens come from. One interface (`base.Drafter`), one module or folder per drafter."""
