"""The zoo compiler: spec tree -> modules -> cache plan -> prefill/decode graphs -> checkpoint rules."""
