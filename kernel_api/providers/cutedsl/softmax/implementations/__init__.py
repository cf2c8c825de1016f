"""Pure CuTe DSL softmax implementations (imported lazily, at compile time)."""
