"""The compiler: frontends, pass registry and pipeline, compile driver, parity verification, artifact writer."""
