//! The stable diagnostic codes. A code, once published, keeps its meaning: add new codes, never
//! renumber. docs/diagnostics.md lists every one (a test keeps the two in step).

use std::fmt;

/// A stable diagnostic code such as `E0201`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Code(&'static str);

impl Code {
    pub fn as_str(self) -> &'static str {
        self.0
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

macro_rules! codes {
    ($($name:ident = $code:literal, $title:literal;)*) => {
        impl Code {
            $(#[doc = $title] pub const $name: Code = Code($code);)*
        }
        /// Every code with its one-line title, in order.
        pub const ALL_CODES: &[(Code, &str)] = &[$((Code::$name, $title)),*];
    };
}

codes! {
    // Syntax
    SYNTAX = "E0001", "syntax error";
    UNCLOSED_BLOCK = "E0002", "a block is missing its closing `}`";
    BAD_LITERAL = "E0003", "a literal is malformed or out of range";
    NOT_UTF8 = "E0004", "the source file is not valid UTF-8";
    // Names
    UNDEFINED_NAME = "E0101", "a name is used but never defined";
    DUPLICATE_NAME = "E0102", "a name is defined twice in one scope";
    UNKNOWN_FUNCTION = "E0103", "a call names no op and no layer";
    NO_MODEL = "E0104", "the file has no model, or not the one asked for";
    UNKNOWN_ATTRIBUTE = "E0105", "an attribute is not one dfc knows";
    WRONG_KIND_OF_NAME = "E0106", "a name is used as something it is not";
    // Types and shapes
    SHAPE_MISMATCH = "E0201", "operand shapes do not broadcast or do not agree";
    DTYPE_MISMATCH = "E0202", "operand element types disagree or are not allowed";
    MATMUL_MISMATCH = "E0203", "the inner dimensions of a matrix product differ";
    INVALID_SHAPE = "E0204", "a shape is malformed, or the element counts differ";
    AXIS_OUT_OF_RANGE = "E0205", "an axis or rank is out of range";
    ANNOTATION_MISMATCH = "E0206", "a value does not have its annotated type";
    BAD_DIM = "E0207", "a dim has no value, a bad value, or an unknown override";
    NOT_CONSTANT = "E0208", "a compile-time constant is needed here";
    // Calls
    ARITY = "E0301", "a call has the wrong number of arguments";
    UNKNOWN_ARGUMENT = "E0302", "a keyword argument is not one the callee takes";
    DUPLICATE_ARGUMENT = "E0303", "an argument is given twice, or positionally after keywords";
    ARGUMENT_KIND = "E0304", "an argument is of the wrong kind";
    MISSING_ARGUMENT = "E0305", "a required argument is missing";
    // Layers
    LAYER_UNIFICATION = "E0401", "a layer argument does not fit the layer's parameter type";
    LAYER_WITHOUT_RETURN = "E0402", "a layer has no `return`";
    MISPLACED_STATEMENT = "E0403", "a statement is not allowed where it stands";
    RECURSIVE_LAYER = "E0404", "a layer calls itself";
    LAYERS_TOO_DEEP = "E0405", "layers call layers too deeply";
    // Model-level
    BAD_DEVICE = "E0501", "a device specification is malformed";
    BAD_PARTITIONING = "E0502", "a partitioning request is invalid";
    BAD_INITIALIZER = "E0503", "a parameter initialiser is unknown or malformed";
    BAD_OPTIMIZER = "E0504", "an optimizer is unknown or malformed";
    BAD_LOSS = "E0505", "the minimized value is not a floating-point scalar";
    DUPLICATE_MINIMIZE = "E0506", "a model has more than one `minimize`";
    BAD_OUTPUT = "E0507", "an output is malformed or named twice";
    // Placement
    NO_SUCH_DEVICE = "E0601", "a requested device is not in the cluster";
    PLACEMENT_CONFLICT = "E0602", "placement requirements contradict each other";
    BATCH_SPLIT = "E0603", "the batch cannot be split over the replicas";
    // Warnings
    UNUSED = "W0001", "a definition is never used";
    NOTHING_TO_RUN = "W0002", "a model has neither outputs nor a `minimize`";
    NOT_TRAINED = "W0003", "a trainable param does not affect the loss";
    SOFT_PLACEMENT = "W0004", "a device request is set aside (soft placement)";
    NOTHING_TO_TRAIN = "W0005", "the loss depends on no trainable param";
}
