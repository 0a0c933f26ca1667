# cmake -DINPUT=<file> -DOUTPUT=<header> -DSYMBOL=<name> -DNAMESPACE=<ns> -P embed.cmake
#
# Writes a header that defines `inline constexpr const char SYMBOL[]` in
# namespace NAMESPACE, holding INPUT's text as a raw string: the device code
# lives in real .cuh files (formatted, compiled on their own in the tests)
# and reaches NVRTC from inside the binary, with no file to find at run time.
file(READ "${INPUT}" text)
string(FIND "${text}" ")mfembed\"" clash)
if(NOT clash EQUAL -1)
  message(FATAL_ERROR "${INPUT} contains )mfembed\" and cannot be embedded as a raw string")
endif()
file(WRITE "${OUTPUT}.tmp"
  "// Generated at build time from ${INPUT} by cmake/embed.cmake: edit that file.\n"
  "#pragma once\n\nnamespace ${NAMESPACE} {\n\n"
  "inline constexpr const char ${SYMBOL}[] = R\"mfembed(${text})mfembed\";\n\n"
  "} // namespace ${NAMESPACE}\n")
# Only a changed text touches the header (and rebuilds what includes it).
file(COPY_FILE "${OUTPUT}.tmp" "${OUTPUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUTPUT}.tmp")
