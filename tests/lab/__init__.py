"""Device lab for the deploy tests: real sshd processes as devices on 127.0.0.x loopback addresses."""
