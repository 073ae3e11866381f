"""The Tinker SDK's client surface over an engine: `ServiceClient`, `TrainingClient`, `SamplingClient`,
`RestClient`, with the SDK's names, signatures and futures."""
