"""What both sides share about trust: certificates, TLS contexts and pinning."""
