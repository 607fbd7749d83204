# concord_warnings(target): the project's warning set, errors when CONCORD_WERROR.
function(concord_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${CONCORD_WERROR}>>:-Werror>)
endfunction()
