"""Speculative decoding: proposals checked by the target model inside the batch."""
